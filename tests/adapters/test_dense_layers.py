"""sentence-transformers' modules read from a directory: Dense weights, and every module
layout Ember refuses rather than serve other vectors than the model's (hostile files
included: a pickle, a path out of the directory)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from ember.adapters import transformer
from ember.adapters._dense_layers import read_weights
from ember.adapters.base import EncodeOptions, Runtime
from ember.errors import ModelLoadError
from tests.adapters.tiny_models import build_bi_encoder, build_st_pipeline, spec_for

TORCH = Runtime(backend="torch")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bi_encoder(tmp_path_factory.mktemp("dense-base") / "base", normalize=False)


@pytest.fixture
def with_dense(base: Path, tmp_path: Path) -> Path:
    return build_st_pipeline(tmp_path / "model", base, dense=[(8, torch.nn.Tanh(), True)])


def load(directory: Path, **fields: object) -> transformer.TransformerAdapter:
    return transformer.load(spec_for(directory, "transformer", ("encode",), **fields), TORCH)


def vector(adapter: transformer.TransformerAdapter) -> np.ndarray:
    items, params = adapter.prepare(["the cat is big"], EncodeOptions())
    return adapter.forward(items, params)[0]


def modules(directory: Path) -> list[dict[str, object]]:
    loaded: list[dict[str, object]] = json.loads((directory / "modules.json").read_text())
    return loaded


def write_modules(directory: Path, entries: list[dict[str, object]]) -> None:
    (directory / "modules.json").write_text(json.dumps(entries))


def dense_folder(directory: Path) -> Path:
    return directory / next(str(m["path"]) for m in modules(directory)
                            if str(m["type"]).endswith("Dense"))


def test_pickled_dense_weights_load_only_where_the_spec_allows(with_dense: Path) -> None:
    expected = vector(load(with_dense))
    folder = dense_folder(with_dense)
    weights = load_file(str(folder / "model.safetensors"))
    state = {key: torch.from_numpy(value) for key, value in weights.items()}
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin is a pickle.*allow_pickle"):
        load(with_dense)
    pickled = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").unlink()  # as a Hub download without allow_pickle leaves it
    with pytest.raises(ModelLoadError, match=r"holds no weights.*allow_pickle: true"):
        load(with_dense)
    (folder / "pytorch_model.bin").write_bytes(pickled)
    np.testing.assert_allclose(vector(load(with_dense, allow_pickle=True)), expected,
                               rtol=1e-6)


class Payload:
    """A pickle that runs code when loaded: it would create `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_is_refused_even_where_pickles_are_allowed(
        with_dense: Path, tmp_path: Path) -> None:
    folder = dense_folder(with_dense)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    (folder / "pytorch_model.bin").write_bytes(
        pickle.dumps({"linear.weight": Payload(marker)}, protocol=2))
    with pytest.raises(ModelLoadError, match="refused by torch's weights-only unpickler"):
        load(with_dense, allow_pickle=True)
    assert not marker.exists()


def test_a_module_path_out_of_the_directory_is_refused(with_dense: Path,
                                                       tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    shutil.copytree(dense_folder(with_dense), outside)
    entries = modules(with_dense)
    for entry in entries:
        if str(entry["type"]).endswith("Dense"):
            entry["path"] = "../elsewhere"
    write_modules(with_dense, entries)
    with pytest.raises(ModelLoadError, match=r"module path '\.\./elsewhere' leaves"):
        load(with_dense)


def test_a_module_ember_does_not_run_is_refused_not_skipped(with_dense: Path) -> None:
    entries = modules(with_dense)
    entries.insert(2, {"idx": 9, "name": "9", "path": "9_LayerNorm",
                       "type": "sentence_transformers.models.LayerNorm"})
    write_modules(with_dense, entries)
    with pytest.raises(ModelLoadError, match="a LayerNorm module is not one Ember runs"):
        load(with_dense)


def test_token_vectors_without_pooling_are_refused(with_dense: Path) -> None:
    # PyLate's ColBERT layout: the encoder, then a Dense layer over every token.
    write_modules(with_dense, [m for m in modules(with_dense)
                               if not str(m["type"]).endswith(("Pooling", "Normalize"))])
    with pytest.raises(ModelLoadError, match=r"no Pooling module.*ColBERT"):
        load(with_dense)


def test_a_dense_layer_after_normalize_is_refused(with_dense: Path) -> None:
    entries = modules(with_dense)
    entries.append(entries.pop(2))  # Dense after Normalize
    write_modules(with_dense, entries)
    with pytest.raises(ModelLoadError, match="a Dense module after Normalize"):
        load(with_dense)


@pytest.mark.parametrize(("change", "message"), [
    ({"out_features": 9}, r"linear\.weight has shape \(8, 32\), but its config says"),
    ({"in_features": 16, "out_features": 8}, r"linear\.weight has shape \(8, 32\)"),
    ({"activation_function": "torch.nn.modules.activation.GELU"},
     r"activation .*GELU.* is not supported"),
    ({"use_residual": True}, "residual connection is not supported"),
])
def test_a_dense_config_that_does_not_fit_is_refused(with_dense: Path, change: dict[str, object],
                                                     message: str) -> None:
    config_file = dense_folder(with_dense) / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(ModelLoadError, match=message):
        load(with_dense)


def test_a_first_dense_layer_must_take_the_models_width(with_dense: Path) -> None:
    folder = dense_folder(with_dense)
    weights = load_file(str(folder / "model.safetensors"))
    from safetensors.numpy import save_file

    save_file({"linear.weight": np.zeros((8, 16), np.float32),
               "linear.bias": weights["linear.bias"]}, str(folder / "model.safetensors"))
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "in_features": 16}))
    with pytest.raises(ModelLoadError, match="first Dense module takes 16 features, but the "
                                             "model gives 32"):
        load(with_dense)


def test_a_config_without_an_activation_means_tanh(with_dense: Path) -> None:
    # sentence-transformers leaves a default out of the saved config.
    expected = vector(load(with_dense))
    config_file = dense_folder(with_dense) / "config.json"
    config = json.loads(config_file.read_text())
    assert config.pop("activation_function").endswith("Tanh")
    config_file.write_text(json.dumps(config))
    np.testing.assert_allclose(vector(load(with_dense)), expected, rtol=1e-6)


@pytest.mark.parametrize(("file", "content", "message"), [
    ("modules.json", b"[{", r"modules\.json is not valid JSON"),
    ("modules.json", b'{"0": "Transformer"}', r"modules\.json holds an object, where an array is"),
    ("modules.json", b'["Transformer"]', r"modules\.json: each module is a JSON object"),
    ("modules.json", b"[" * 200_000 + b"]" * 200_000, r"modules\.json is not valid JSON "
                                                      r"\(nested too deeply\)"),
    ("modules.json", b"\xff\xfe\x00", r"modules\.json is not valid JSON"),
    ("config_sentence_transformers.json", b'{"prompts": ["query: "]}', r"prompts is not a"),
    ("1_Pooling/config.json", b"[]", r"config\.json holds an array, where an object is"),
    ("2_Dense/config.json", b'{"in_features": "32", "out_features": 8}',
     r"in_features is '32', where a whole number"),
])
def test_a_hostile_json_file_fails_the_load_with_its_name(with_dense: Path, file: str,
                                                          content: bytes, message: str) -> None:
    (with_dense / file).write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        load(with_dense)


def test_an_oversized_json_file_is_refused_before_it_is_parsed(with_dense: Path) -> None:
    from ember.model_files import MAX_MODEL_JSON_BYTES

    with (with_dense / "modules.json").open("wb") as out:
        out.truncate(MAX_MODEL_JSON_BYTES + 1)  # sparse: no 16 MB written
    with pytest.raises(ModelLoadError, match=r"modules\.json is 16,777,217 bytes, over"):
        load(with_dense)


def test_a_hostile_sentence_transformers_config_is_a_catalog_error(with_dense: Path) -> None:
    from ember.config import CatalogError, load_catalog

    (with_dense / "config_sentence_transformers.json").write_bytes(b'"CrossEncoder"')
    with pytest.raises(CatalogError, match=r"config_sentence_transformers\.json holds a "
                                           r"string, where an object is expected"):
        load_catalog(model_paths=[with_dense])


def safetensors_header(header: dict[str, object], data: bytes = b"") -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


@pytest.mark.parametrize(("content", "message"), [
    (b"not a safetensors file", "not a readable safetensors file"),
    (struct.pack("<Q", 1 << 60) + b"{}", "header too large"),  # a header claiming exabytes
    (safetensors_header({"linear.weight": {"dtype": "F32", "shape": [100_000, 100_000],
                                           "data_offsets": [0, 40_000_000_000]}},
                        b"\0" * 16), "not a readable safetensors file"),  # data past the end
])
def test_hostile_safetensors_dense_weights_fail_the_load(with_dense: Path, content: bytes,
                                                         message: str) -> None:
    (dense_folder(with_dense) / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        load(with_dense)


def test_a_pickle_that_holds_no_state_dict_is_refused(with_dense: Path) -> None:
    folder = dense_folder(with_dense)
    (folder / "model.safetensors").unlink()
    torch.save([torch.zeros(8, 32)], folder / "pytorch_model.bin")  # a list, not a dict
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin holds no state dict"):
        load(with_dense, allow_pickle=True)


def _deeply_nested_state(path: Path) -> None:
    """torch's zip layout around a pickle of 100,000 nested lists: an unpickler that
    recursed would overflow its stack."""
    import zipfile

    torch.save({"weight": torch.zeros(2)}, path.with_suffix(".base"))
    depth = 100_000
    deep = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    with zipfile.ZipFile(path.with_suffix(".base")) as source, \
            zipfile.ZipFile(path, "w") as target:
        for entry in source.infolist():
            data = source.read(entry.filename)
            target.writestr(entry, deep if entry.filename.endswith("data.pkl") else data)


def _cut_short(path: Path) -> None:
    torch.save({"weight": torch.zeros(1000, 100)}, path)
    path.write_bytes(path.read_bytes()[:20_000])  # a download that stopped halfway


@pytest.mark.parametrize(("make", "message"), [
    (_deeply_nested_state, "holds no state dict"),
    (_cut_short, "refused by torch's weights-only unpickler"),
    (lambda path: path.write_bytes(pickle.dumps({"weight": [1.0]}, protocol=2)[:-3]),
     "refused by torch's weights-only unpickler"),  # a bare pickle, not torch's layout
])
def test_hostile_pickled_weights_under_any_file_name_fail_the_load(tmp_path: Path, make: Any,
                                                                     message: str) -> None:
    """`read_weights` as the M3 family calls it, with its heads' file names."""
    make(tmp_path / "sparse_linear.pt")
    with pytest.raises(ModelLoadError, match=message):
        read_weights(tmp_path, "m", True, "sparse_linear.safetensors", "sparse_linear.pt")


def test_pickled_weights_keep_only_their_tensors(tmp_path: Path) -> None:
    """Nested containers and other values in a state dict are left out, not built on."""
    torch.save({"weight": torch.ones(1, 4), "nested": {"bias": torch.zeros(1)},
                "note": "text"}, tmp_path / "head.pt")
    found = read_weights(tmp_path, "m", True, "head.safetensors", "head.pt")
    assert set(found) == {"weight"} and found["weight"].dtype == np.float32
