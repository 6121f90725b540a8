"""Images on the request path: decoding untrusted bytes with Pillow, and the vision
preprocessing of CLIP and SigLIP checkpoints (resize, center crop, rescale, normalize) as
their own image processors do it, read from the model's preprocessor_config.json.

Decoding is guarded: the format is sniffed from the bytes and only PNG, JPEG, WebP and
GIF (its first frame) are opened, each with its one Pillow plugin; the dimensions are
checked against MAX_PIXELS from the header, before any pixel is decoded, so a small
file that would inflate to gigabytes is refused; a truncated or corrupt file is an
error, never a partial image. Every refusal is an InvalidInput (422) naming the field.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageFile, ImageOps

from ember.adapters.base import Encoded, EncodeOptions, ScoreOptions, Submit, TaskOutput
from ember.errors import InvalidInput
from ember.model_files import read_model_json

# 40 megapixels (e.g. 8000 x 5000) decode to 120 MB of RGB; beyond it a request is refused.
MAX_PIXELS = 40_000_000
MAX_SIDE = 20_000  # a 1 x 40M strip is no photo either
# A progressive JPEG is decoded once per scan, and nothing in libjpeg bounds their count: a
# 700 KB file of 20,000 repeated scans took 25 s. Real files have about 10.
MAX_JPEG_SCANS = 100
START_OF_SCAN = b"\xff\xda"  # 0xFF in the entropy-coded data is always stuffed: a marker
# Resized whole up to this many pixels, as the image processors do it; past it (a strip of
# an absurd aspect ratio: 1 x 2,000 resizes to 224 x 448,000), only what the crop keeps.
WHOLE_RESIZE_PIXELS = 4_000_000
ORIENTATION = 0x0112  # the EXIF tag
# Pillow's own guard, as a second line behind the header check below.
Image.MAX_IMAGE_PIXELS = MAX_PIXELS
ImageFile.LOAD_TRUNCATED_IMAGES = False  # a cut file is an error, never a grey half

# Accepted formats: the names a request may give -> Pillow's plugin.
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF"}
ACCEPTED = "png, jpeg, webp or gif"
Pixels = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ImageInput:
    """One image of a request: its bytes and the format the client named, if any."""

    data: bytes
    format: str | None = None


@dataclass(frozen=True)
class ItemInput:
    """One item of a request that may carry images: its text, its images, or both."""

    text: str | None = None
    images: tuple[ImageInput, ...] = ()


@runtime_checkable
class ImageModel(Protocol):
    """A model whose items may carry images (the request path's half)."""

    takes_images: bool

    async def encode_items(self, submit: Submit, items: Sequence[ItemInput],
                           options: EncodeOptions) -> TaskOutput[list[Encoded]]: ...

    async def score_items(self, submit: Submit, query: ItemInput, items: Sequence[ItemInput],
                          options: ScoreOptions) -> TaskOutput[list[float]]: ...


def sniff(data: bytes) -> str | None:
    """The format the bytes' signature says, or None when it is none of the accepted."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def decode(image: ImageInput, param: str) -> Image.Image:
    """The image as RGB (alpha composited over white, as the processors do), or an
    InvalidInput naming `param`. Any thread may call it; Pillow releases the GIL."""
    declared = None
    if image.format is not None:
        declared = FORMATS.get(image.format.strip().lower().removeprefix("image/"))
        if declared is None:
            raise InvalidInput(f"image format {image.format!r} is not accepted; send "
                               f"{ACCEPTED}", f"{param}.format")
    found = sniff(image.data)
    if found is None:
        raise InvalidInput(f"the image data is not a {ACCEPTED} file (its first bytes "
                           "match none of them); send one of those formats", f"{param}.data")
    if declared is not None and declared != FORMATS[found]:
        raise InvalidInput(f"format says {image.format!r} but the data is {found}; fix "
                           "format or leave it out", f"{param}.format")
    try:
        with warnings.catch_warnings():
            # Pillow warns of each flaw it skips in a client's file (a damaged EXIF block):
            # a log line a request could repeat at will. A bomb's warning is a refusal.
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(image.data), formats=[FORMATS[found]])
            width, height = opened.size  # from the header: nothing is decoded yet
            if width * height > MAX_PIXELS or max(width, height) > MAX_SIDE:
                raise too_large(f"{width} x {height} pixels", param)
            if found == "jpeg" and (scans := image.data.count(START_OF_SCAN)) > MAX_JPEG_SCANS:
                raise InvalidInput(f"the jpeg image has {scans:,} scans, over the limit of "
                                   f"{MAX_JPEG_SCANS} (a photo has about 10); save it again "
                                   "as a baseline jpeg", f"{param}.data")
            opened.seek(0)  # an animated GIF or WebP: its first frame
            opened.load()
            # Upright as it is shown: a phone photo is stored sideways with an EXIF
            # orientation (transformers' load_image turns it too).
            return to_rgb(upright(opened))
    except InvalidInput:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow refuses in open(), before the size can be read: its message has the count.
        count = re.search(r"\((\d+) pixels\)", str(exc))
        raise too_large(f"{int(count.group(1)):,} pixels" if count else "its size",
                        param) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidInput(f"the {found} image could not be decoded ({_reason(exc)}): it "
                           "is corrupt or truncated", f"{param}.data") from None


def is_image_data_uri(value: str) -> bool:
    """A string that is an image's data URI (what a text-only route would embed as text)."""
    return value.startswith("data:image/")


def upright(image: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says it is shown; a damaged EXIF block (a
    client's bytes) counts as none."""
    try:
        turn = image.getexif().get(ORIENTATION, 1)
        if isinstance(turn, int) and 2 <= turn <= 8:
            return ImageOps.exif_transpose(image)
    except Exception:  # the picture is still good; only its turn is lost
        pass
    return image


def too_large(size: str, param: str) -> InvalidInput:
    return InvalidInput(f"image of {size} is over the limit of {MAX_PIXELS:,} pixels "
                        f"({MAX_SIDE} a side); send a smaller image", f"{param}.data")


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return _OBJECT_REPR.sub("", text)[:120]  # Pillow names the buffer by its address


_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited over white (what the processors' own
    convert-to-RGB does); 16-bit gray scaled to 8 bits first (Pillow's conversion clips
    it: every value past 255 would become white)."""
    if image.mode.startswith("I;16") or image.mode == "I":
        wide = np.asarray(image).astype(np.int32)  # I;16 and I fit: half of int64's memory
        image = Image.fromarray((np.clip(wide, 0, 65535) >> 8).astype(np.uint8), "L")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        return over_white(image)
    return image.convert("RGB")


COMPOSITE_ROWS = 256  # rows composited at a time


def over_white(image: Image.Image) -> Image.Image:
    """`image` composited over white, as RGB, a strip of rows at a time: whole, a 40 MP
    image with alpha took four more full-size copies (1.1 GB for a 1.6 kB WebP). Each pixel
    is composited alone, so the strips give the same pixels."""
    rgba = image if image.mode == "RGBA" else image.convert("RGBA")
    out = Image.new("RGB", rgba.size)
    for top in range(0, rgba.height, COMPOSITE_ROWS):
        box = (0, top, rgba.width, min(top + COMPOSITE_ROWS, rgba.height))
        strip = rgba.crop(box)
        white = Image.new("RGBA", strip.size, (255, 255, 255, 255))
        out.paste(Image.alpha_composite(white, strip).convert("RGB"), box[:2])
    return out


# The image processors' defaults for keys a preprocessor_config.json leaves out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224},
             "do_center_crop": True, "resample": 3,
             "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711]},
    "siglip": {"size": {"height": 224, "width": 224}, "do_center_crop": False,
               "resample": 3, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}


@dataclass(frozen=True)
class Preprocessor:
    """A checkpoint's image preprocessing: resize (the shortest edge to `shortest_edge`,
    or to `height` x `width`), center crop, rescale, normalize; CHW float32 out."""

    height: int | None
    width: int | None
    shortest_edge: int | None
    resample: int
    crop: tuple[int, int] | None
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, config: dict[str, Any], kind: str) -> Preprocessor:
        settings = {**_DEFAULTS[kind], **config}
        size = settings["size"]
        if isinstance(size, int):
            size = {"shortest_edge": size} if kind == "clip" else {"height": size, "width": size}
        crop = settings.get("crop_size") or {}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        normalize = settings.get("do_normalize", True)
        return cls(
            height=size.get("height"), width=size.get("width"),
            shortest_edge=size.get("shortest_edge") if settings.get("do_resize", True) else None,
            resample=int(settings.get("resample", 3)),
            crop=(int(crop["height"]), int(crop["width"]))
            if settings.get("do_center_crop") and crop else None,
            rescale=float(settings.get("rescale_factor", 1 / 255))
            if settings.get("do_rescale", True) else None,
            mean=tuple(settings["image_mean"]) if normalize else None,
            std=tuple(settings["image_std"]) if normalize else None)

    @classmethod
    def from_directory(cls, model_dir: Path, kind: str) -> Preprocessor:
        path = model_dir / "preprocessor_config.json"
        config = read_model_json(path) if path.is_file() else {}  # a bad file: ModelFileError
        return cls.from_config(config, kind)

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, when fixed."""
        if self.crop is not None:
            return self.crop
        if self.height and self.width and self.shortest_edge is None:
            return self.height, self.width
        return None

    def __call__(self, image: Image.Image, param: str = "images[0]") -> Pixels:
        width, height = image.size
        if self.shortest_edge is not None:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            size = (new_short, new_long) if width <= height else (new_long, new_short)
            image = self._resize(image, size, param)
        elif self.height and self.width:
            image = image.resize((self.width, self.height),
                                 resample=Image.Resampling(self.resample))
        array = np.asarray(image).transpose(2, 0, 1)  # HWC uint8 -> CHW
        if self.crop is not None:
            array = center_crop(array, *self.crop)
        pixels: Pixels
        if self.rescale is not None:
            pixels = (array.astype(np.float64) * self.rescale).astype(np.float32)
        else:
            pixels = array.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            pixels = ((pixels - mean) / std).astype(np.float32)
        return np.ascontiguousarray(pixels)

    def _resize(self, image: Image.Image, size: tuple[int, int], param: str) -> Image.Image:
        """`image` resized to `size` (width, height). Past WHOLE_RESIZE_PIXELS, only the
        part the center crop keeps is made, a pass a side: each kept pixel is computed
        from the same source pixels with the same weights as in the whole resize."""
        resample = Image.Resampling(self.resample)
        if size[0] * size[1] <= WHOLE_RESIZE_PIXELS:
            return image.resize(size, resample=resample)
        if self.crop is None:  # the model takes the whole resized image
            if size[0] * size[1] > MAX_PIXELS:
                raise InvalidInput(f"image of {image.width} x {image.height} pixels would be "
                                   f"resized to {size[0]} x {size[1]}, over the limit of "
                                   f"{MAX_PIXELS:,} pixels; send an image of a usual aspect "
                                   "ratio", f"{param}.data")
            return image.resize(size, resample=resample)
        (crop_height, crop_width), (width, height) = self.crop, image.size
        keep_width, keep_height = min(crop_width, size[0]), min(crop_height, size[1])
        left, top = (size[0] - keep_width) // 2, (size[1] - keep_height) // 2
        x_scale, y_scale = width / size[0], height / size[1]
        columns = image.resize((keep_width, height), resample=resample, box=(
            left * x_scale, 0, (left + keep_width) * x_scale, height))
        return columns.resize((keep_width, keep_height), resample=resample, box=(
            0, top * y_scale, keep_width, (top + keep_height) * y_scale))


def center_crop(array: npt.NDArray[Any], height: int, width: int) -> npt.NDArray[Any]:
    """The centre `height` x `width` of a CHW array; zero padding where it is smaller
    (the processors' own rule: the top-left of the centre, rounding down)."""
    _, rows, cols = array.shape
    if rows < height or cols < width:
        padded = np.zeros((array.shape[0], max(rows, height), max(cols, width)),
                          dtype=array.dtype)
        top, left = -(-(padded.shape[1] - rows) // 2), -(-(padded.shape[2] - cols) // 2)
        padded[:, top:top + rows, left:left + cols] = array
        array, rows, cols = padded, padded.shape[1], padded.shape[2]
    top, left = (rows - height) // 2, (cols - width) // 2
    return array[:, top:top + height, left:left + width]
