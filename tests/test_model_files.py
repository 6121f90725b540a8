"""The checked reader of a model directory's JSON files, on hostile files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember import hub
from ember.model_files import MAX_MODEL_JSON_BYTES, ModelFileError, read_model_json


@pytest.mark.parametrize(("content", "expect", "message"), [
    (b'{"a": 1}', list, r"x\.json holds an object, where an array is expected"),
    (b"[1]", dict, r"x\.json holds an array, where an object is expected"),
    (b"null", dict, r"holds null"),
    (b"3.5", dict, r"holds a number"),
    (b'{"a": ', dict, r"x\.json is not valid JSON \(Expecting value"),
    (b"\x80\x81", dict, r"x\.json is not valid JSON"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, dict, r"not valid JSON \(nested too deeply\)"),
])
def test_a_file_that_is_not_the_expected_json_names_itself(
        tmp_path: Path, content: bytes, expect: type, message: str) -> None:
    (tmp_path / "x.json").write_bytes(content)
    with pytest.raises(ModelFileError, match=message):
        read_model_json(tmp_path / "x.json", expect)


def test_an_oversized_file_is_refused_unread(tmp_path: Path) -> None:
    with (tmp_path / "x.json").open("wb") as out:
        out.truncate(MAX_MODEL_JSON_BYTES + 1)
    with pytest.raises(ModelFileError, match="over the"):
        read_model_json(tmp_path / "x.json")
    (tmp_path / "y.json").write_bytes(b'{"fine": [1, 2]}')
    assert read_model_json(tmp_path / "y.json") == {"fine": [1, 2]}


def test_a_gliner_folder_with_a_broken_config_is_a_hub_error(tmp_path: Path) -> None:
    (tmp_path / "gliner_config.json").write_bytes(b'["not", "an", "object"]')
    with pytest.raises(hub.HubError, match=r"gliner_config\.json holds an array"):
        hub.backbone(tmp_path)


def test_a_class_mapped_to_code_is_found_at_any_depth_of_any_config(tmp_path: Path) -> None:
    from ember.model_files import maps_to_code

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "path": ""}]))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"auto_map": "a vocabulary's word"}))
    assert maps_to_code(tmp_path) is None  # an array is read through; a vocabulary is not
    (tmp_path / "gliner_config.json").write_text(json.dumps(
        {"encoder_config": {"layers": [{"auto_map": {"AutoModel": "x--code.Model"}}]}}))
    assert maps_to_code(tmp_path) == "gliner_config.json maps a class to code (auto_map)"
    (tmp_path / "gliner_config.json").unlink()
    # A file the check cannot read through counts as one that maps code: transformers
    # read a 17 MB config.json the check skipped (found by a second review).
    (tmp_path / "broken.json").write_text("{not json")
    assert str(maps_to_code(tmp_path)).startswith("broken.json cannot be checked for code")
