"""Image decoding (formats, hostile bytes) and preprocessing, which must equal the
checkpoint's own AutoProcessor output on the same images."""

from __future__ import annotations

import io
import struct
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from ember.adapters._images import (
    MAX_JPEG_SCANS,
    MAX_PIXELS,
    WHOLE_RESIZE_PIXELS,
    ImageInput,
    Preprocessor,
    decode,
    sniff,
)
from ember.errors import InvalidInput
from tests.adapters.tiny_clip import build_clip, build_siglip


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(mode) if mode in ("RGB", "RGBA") else 1
    array = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(array.squeeze(-1) if bands == 1 else array, mode)


def encoded(image: Image.Image, fmt: str, **save: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def two_frame_gif() -> bytes:
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    return encoded(red, "GIF", save_all=True, append_images=[blue], duration=50)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` with a few bytes of pixel data: what a
    decompression bomb looks like before it is decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("fmt, name", [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp"),
                                       ("GIF", "gif")])
def test_each_accepted_format_decodes_and_is_sniffed(fmt: str, name: str) -> None:
    source = picture(20, 12)
    data = encoded(source, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    assert sniff(data) == name
    for declared in (None, name, f"image/{name}", name.upper()):
        image = decode(ImageInput(data, declared), "items[0].images[0]")
        assert image.mode == "RGB" and image.size == (20, 12)
    if fmt == "PNG":  # lossless: the very pixels
        assert np.array_equal(np.asarray(decode(ImageInput(data), "x")), np.asarray(source))


def test_gif_gives_its_first_frame() -> None:
    image = decode(ImageInput(two_frame_gif()), "items[0].images[0]")
    assert image.getpixel((3, 3)) == (255, 0, 0)


def test_transparency_is_composited_over_white() -> None:
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    image = decode(ImageInput(encoded(clear, "PNG")), "x")
    assert image.getpixel((0, 0)) == (255, 255, 255)


def test_compositing_by_strips_gives_the_whole_images_pixels() -> None:
    """Composited a strip of rows at a time (whole, a 1.6 kB WebP of 40 MP took 1.1 GB,
    found by a review): the same pixels as the processors' whole-image compositing."""
    from ember.adapters._images import COMPOSITE_ROWS, over_white

    rgba = picture(301, 2 * COMPOSITE_ROWS + 37, "RGBA", seed=9)
    whole = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    assert np.array_equal(np.asarray(over_white(rgba)), np.asarray(whole.convert("RGB")))
    palette = rgba.convert("P")
    palette.info["transparency"] = 0
    assert np.array_equal(np.asarray(over_white(palette)), np.asarray(Image.alpha_composite(
        Image.new("RGBA", rgba.size, (255, 255, 255, 255)), palette.convert("RGBA")
    ).convert("RGB")))


def test_16_bit_gray_is_scaled_to_8_bits_not_clipped() -> None:
    """Found by a black-box review: Pillow's conversion clips 16-bit gray, so every value
    past 255 (almost every pixel of a real 16-bit image) became white."""
    ramp = np.array([[0, 128, 30000, 65535]], dtype=np.uint16)
    image = decode(ImageInput(encoded(Image.fromarray(ramp), "PNG")), "x")
    assert Image.open(io.BytesIO(encoded(Image.fromarray(ramp), "PNG"))).mode.startswith("I")
    assert [image.getpixel((x, 0)) for x in range(4)] == [
        (0, 0, 0), (0, 0, 0), (117, 117, 117), (255, 255, 255)]  # the high byte


def refusal(data: bytes, fmt: str | None = None) -> InvalidInput:
    with pytest.raises(InvalidInput) as caught:
        decode(ImageInput(data, fmt), "items[2].images[0]")
    return caught.value


def test_an_exif_orientation_is_applied_as_the_photo_is_shown() -> None:
    """Found by a black-box review: a phone photo (stored sideways, EXIF orientation 6)
    was embedded sideways, where transformers' load_image turns it upright."""
    stored = picture(60, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to show
    data = encoded(stored, "JPEG", exif=exif.tobytes(), quality=95)
    shown = decode(ImageInput(data), "items[0].images[0]")
    assert shown.size == (30, 60)
    plain = decode(ImageInput(encoded(stored, "JPEG", quality=95)), "items[0].images[0]")
    np.testing.assert_array_equal(np.asarray(shown), np.asarray(plain.transpose(
        Image.Transpose.ROTATE_270)))


def test_a_damaged_exif_block_is_no_turn_and_no_warning() -> None:
    """A client's bytes: each flaw Pillow finds in an EXIF block is a warning, which the
    server would log; the picture is still decoded, as stored."""
    stored = picture(20, 10)
    exif = Image.Exif()
    exif[0x0112] = 6
    whole = exif.tobytes()
    damaged = [whole[:len(whole) - 5], whole[:12] + b"\xff" * 8 + whole[20:],
               b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x01\x01\x12\x00\x03\xff\xff"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for block in damaged:
            shown = decode(ImageInput(encoded(stored, "JPEG", exif=block)), "p")
            assert shown.size in ((20, 10), (10, 20))
    assert not said, [str(w.message) for w in said]


def test_a_format_outside_the_list_is_refused() -> None:
    bmp = encoded(picture(8, 8), "BMP")
    error = refusal(bmp)
    assert error.param == "items[2].images[0].data" and "png, jpeg, webp or gif" in error.message
    error = refusal(encoded(picture(8, 8), "PNG"), "bmp")
    assert error.param == "items[2].images[0].format" and "'bmp'" in error.message
    assert refusal(b"").param == "items[2].images[0].data"
    assert refusal(b"<svg xmlns='http://www.w3.org/2000/svg'/>").param.endswith(".data")


def test_a_declared_format_that_the_bytes_contradict_is_refused() -> None:
    error = refusal(encoded(picture(8, 8), "PNG"), "jpeg")
    assert "png" in error.message and error.param.endswith(".format")


def test_corrupt_and_truncated_bytes_are_refused() -> None:
    png = encoded(picture(64, 64), "PNG")
    jpeg = encoded(picture(64, 64), "JPEG")
    for broken in (png[:len(png) // 2], jpeg[:len(jpeg) // 2], png[:40],
                   b"\x89PNG\r\n\x1a\n" + bytes(200), b"\xff\xd8\xff" + bytes(50),
                   b"GIF89a" + b"\xff" * 30, b"RIFF\0\0\0\0WEBPVP8 " + bytes(20)):
        error = refusal(broken)
        assert "could not be decoded" in error.message or "not a" in error.message, broken[:12]
        assert error.param == "items[2].images[0].data"
        assert "object at 0x" not in error.message  # no buffer's address in a client's answer


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    started = time.monotonic()
    error = refusal(png_claiming(100_000, 100_000))
    assert "over the limit" in error.message and f"{MAX_PIXELS:,}" in error.message
    assert "10,000,000,000 pixels" in error.message or "100000 x 100000" in error.message
    refusal(png_claiming(30_000, 1))  # a side over the limit
    assert time.monotonic() - started < 5  # refused, not decoded (10^10 pixels)


def jpeg_of_scans(repeats: int) -> bytes:
    """A progressive JPEG whose last scan comes `repeats` times more: libjpeg decodes the
    whole image once per scan, so a small file of thousands of scans took seconds a
    thousand (found by a black-box review)."""
    data = encoded(picture(64, 48), "JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    return data[:-2] + data[last:-2] * repeats + b"\xff\xd9"


def test_a_jpeg_of_too_many_scans_is_refused_before_it_is_decoded() -> None:
    ordinary = decode(ImageInput(jpeg_of_scans(0)), "x")  # a progressive photo: 10 scans
    assert ordinary.size == (64, 48)
    error = refusal(jpeg_of_scans(MAX_JPEG_SCANS))
    assert f"over the limit of {MAX_JPEG_SCANS}" in error.message and "scans" in error.message
    assert error.param == "items[2].images[0].data"


# -- preprocessing ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["clip", "siglip"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[str, Path]:
    build = build_clip if request.param == "clip" else build_siglip
    return request.param, build(tmp_path_factory.mktemp(request.param))


SHAPES = [(32, 32, "RGB"), (50, 21, "RGB"), (17, 90, "RGB"), (7, 5, "RGB"),
          (333, 200, "RGB"), (40, 40, "RGBA"), (31, 64, "L")]


def test_preprocessing_equals_the_checkpoints_autoprocessor(model_dir: tuple[str, Path]
                                                            ) -> None:
    kind, folder = model_dir
    processor = AutoProcessor.from_pretrained(str(folder))
    mine = Preprocessor.from_directory(folder, kind)
    for index, (width, height, mode) in enumerate(SHAPES):
        source = picture(width, height, mode, seed=index)
        data = encoded(source, "PNG")
        want = processor(images=Image.open(io.BytesIO(data)),
                         return_tensors="np")["pixel_values"][0]
        got = mine(decode(ImageInput(data), "x"))
        assert got.dtype == np.float32 and got.shape == want.shape == (3, 32, 32)
        assert np.allclose(got, want, atol=1e-5), (kind, width, height, mode,
                                                   float(np.abs(got - want).max()))


def test_preprocessing_reads_real_checkpoint_settings() -> None:
    """openai/clip-vit-base-patch32's preprocessor_config.json, as it ships."""
    config = {"crop_size": 224, "do_center_crop": True, "do_normalize": True,
              "do_resize": True, "feature_extractor_type": "CLIPFeatureExtractor",
              "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 224}
    mine = Preprocessor.from_config(config, "clip")
    pixels = mine(picture(640, 480))
    assert pixels.shape == (3, 224, 224) and mine.output_size == (224, 224)


def test_a_strip_is_resized_only_where_the_crop_keeps_it(
        model_dir: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a black-box review: a 99-byte PNG of 1 x 5,000 pixels, resized whole to a
    shortest edge of 224, made 224 x 1,120,000 pixels and took 2.9 GB. Past
    WHOLE_RESIZE_PIXELS only what the center crop keeps is resized, and it is what the
    checkpoint's own processor gives (within a level of a pixel: Pillow may take its two
    passes the other way round)."""
    kind, folder = model_dir
    processor = AutoProcessor.from_pretrained(str(folder))
    mine = Preprocessor.from_directory(folder, kind)
    made: list[int] = []
    resize = Image.Image.resize

    def recorded(image: Image.Image, size: tuple[int, int], *args: object,
                 **kwargs: object) -> Image.Image:
        made.append(size[0] * size[1])
        return resize(image, size, *args, **kwargs)  # type: ignore[arg-type]

    for index, (width, height) in enumerate([(1, 20_000), (20_000, 3), (60, 19_000)]):
        source = picture(width, height, seed=index)
        want = processor(images=source, return_tensors="np")["pixel_values"][0]
        with monkeypatch.context() as patch:
            patch.setattr(Image.Image, "resize", recorded)
            got = mine(source)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1.01 / 255 / min(mine.std or (1.0,)), (
            kind, width, height)
    assert max(made) <= WHOLE_RESIZE_PIXELS


def test_a_strip_a_model_would_take_whole_is_refused() -> None:
    """A checkpoint that resizes the shortest edge and crops nothing takes the whole
    resized image: one of an absurd aspect ratio is refused, not made."""
    mine = Preprocessor.from_config({"do_center_crop": False}, "clip")
    with pytest.raises(InvalidInput) as refused:
        mine(picture(1, 20_000), "items[0].images[0]")
    assert "resized to 224 x 4480000" in refused.value.message
    assert refused.value.param == "items[0].images[0].data"
