"""Model catalog: the shipped defaults, user folders, and clear errors for bad YAML."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from ember.config import (
    FAMILY_OUTPUTS,
    CatalogError,
    load_catalog,
    m3_score_weights,
    parse_spec,
    resolve_source,
)
from ember.engine import WorkerConfig


def test_builtin_catalog_has_the_default_models_resolving_offline() -> None:
    catalog = load_catalog()
    minilm = catalog["sentence-transformers/all-MiniLM-L6-v2"]
    assert minilm.tasks == ("encode", "score")
    assert (resolve_source(minilm) / "model.safetensors").is_file()
    spacy = catalog["spacy/en_core_web_sm"]
    assert spacy.tasks == ("extract",) and resolve_source(spacy).is_dir()
    assert "not a real model" in catalog["ember/synthetic"].description


def test_a_yaml_file_in_a_model_dir_adds_a_model(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "mine.yaml").write_text(
        "name: me/mine\nadapter: transformer\nsource: {path: ./weights}\n"
        "tasks: [encode]\nbatching: {max_batch_items: 8}\n")
    spec = load_catalog([tmp_path])["me/mine"]
    assert spec.source.path == tmp_path / "weights"
    assert spec.worker_config(WorkerConfig()).max_batch_items == 8


@pytest.mark.parametrize(("text", "message"), [
    ("adapter: transformer\ntasks: [encode]\n", "missing required field 'name'"),
    ("name: x\nadapter: magic\ntasks: [encode]\n", "adapter 'magic' is unknown"),
    ("name: x\nadapter: transformer\ntasks: [fly]\nsource: {path: .}\n", "tasks must be"),
    ("name: x\nadapter: transformer\ntasks: [encode]\n", "needs one of package, path or hub"),
    ("name: x\nadapter: synthetic\ntasks: [encode]\nbatching: {speed: 3}\n",
     "batching.speed is not a setting; 'batching' accepts only"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_bad_yaml_names_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(CatalogError, match=r"bad\.yaml") as caught:
        load_catalog([tmp_path])
    assert message in str(caught.value)


# Found by a black-box review: each of these started, then was ignored (a misspelt field)
# or failed every request with a 502 (a bad value), instead of stopping the start.
HUB = "source: {hub: org/tiny}\n"


@pytest.mark.parametrize(("body", "message"), [
    (f"{HUB}pooling_mode: mean\n", "unknown field pooling_mode (did you mean pooling?)"),
    (f"{HUB}normalise: false\n", "unknown field normalise (did you mean normalize?)"),
    (f"{HUB}prompt: {{query: 'q: '}}\n", "unknown field prompt (did you mean prompts?)"),
    (f"{HUB}colour: blue\n", "unknown field colour; a model YAML accepts name, "),
    ("source: {hub: org/tiny, revison: abc}\n",
     "unknown field source.revison (did you mean source.revision?)"),
    (f"{HUB}batching: {{max_batch_tokens: -1}}\n",
     "batching.max_batch_tokens must be >= 1, got -1"),
    (f"{HUB}batching: {{max_batch_items: many}}\n",
     "batching.max_batch_items must be an integer, got 'many'"),
    # Learned unless set, so optional: still an integer when set (a review found `true`
    # taken for a budget of 1 token, and 2048.5 taken as it was).
    (f"{HUB}batching: {{max_batch_tokens: true}}\n",
     "batching.max_batch_tokens must be an integer, got True"),
    (f"{HUB}batching: {{max_batch_tokens: 2048.5}}\n",
     "batching.max_batch_tokens must be an integer, got 2048.5"),
    (f"{HUB}batching: {{max_batch_tokens: abc}}\n",
     "batching.max_batch_tokens must be an integer, got 'abc'"),
    (f"{HUB}batching: {{max_padding: 0.5}}\n", "batching.max_padding must be 0 (off) or >= 1"),
    (f"{HUB}pooling: avg\n", "pooling 'avg' is unknown; use one of mean, cls, max, lasttoken"),
    (f"{HUB}max_seq_length: 0\n", "max_seq_length must be a positive integer"),
    (f"{HUB}max_seq_length: '512'\n", "max_seq_length must be a positive integer"),
    (f"{HUB}allow_pickle: 'false'\n", "allow_pickle must be true or false, got 'false'"),
    (f"{HUB}trust_remote_code: 'no'\n", "trust_remote_code must be true or false, got 'no'"),
    ("source: {path: ., hub: org/tiny}\n", "'source' names path and hub; give exactly one"),
    ("source: {path: ./absent}\n", "absent does not exist"),
    (f"{HUB}loras: {{legal: ./absent}}\n",
     "loras.legal " + "{tmp}/absent is not a PEFT adapter folder (no adapter_config.json)"),
    (f"{HUB}loras: {{legal: .}}\n", "is not a PEFT adapter folder"),
    (f"{HUB}backend: onnx\nloras: {{legal: .}}\n", "loras need backend: torch"),
    (f"{HUB}quantize: int8\nloras: {{legal: .}}\n", "loras need backend: torch"),
    (f"{HUB}backend: torch\nquantize: int8\n", "quantize applies to the onnx backend"),
    # Found by a black-box review: the families read their options with a default, so a
    # misspelt one was ignored.
    (f"{HUB}options: {{dimz: 384}}\n", "unknown field options.dimz (did you mean "
     "options.dims?); options accepts dims, embeddings_side"),
    (f"{HUB}options: {{activation: none}}\n", "unknown field options.activation; options "
     "accepts dims, embeddings_side"),  # a cross-encoder's option, on a transformer
    # Found by a review of the start: each started, then failed /v1/models or every
    # request with a 500, or was never applied.
    ("source: {hub: org/tiny, revision: 1.0}\n", "source.revision must be text, got 1.0; "
     "quote it"),
    ("source: {hub: 12345}\n", "source.hub must be text, got 12345"),
    (f"{HUB}prompts: {{query: 12345}}\n", "prompts.query must be text, got a number"),
    (f"{HUB}prompts: {{querry: 'q: '}}\n",
     "unknown field prompts.querry (did you mean prompts.query?)"),
    (f"{HUB}loras: {{legal: [a, b]}}\n", "loras.legal must be text, got an array"),
    ("source: {hub: org/tiny}\ntasks: [extract]\n", "the transformer family cannot "
     "extract; its tasks are encode, score"),
    (f"{HUB}description: [[x, x], [x, x]]\n", "description must be text, got an array"),
    # Aliases are refused whole since an operator's review (a kilobyte of them is gigabytes).
    (f"{HUB}description: [&a [x, x], [*a, *a]]\n", "an alias (*name): write the value out"),
    # Found by a review: a key given twice took its last value without a word.
    (f"{HUB}options: {{dims: 8}}\noptions: {{dims: 9}}\n",
     "the key 'options' appears twice at line 6, column 1"),
    (f"{HUB}batching: {{max_batch_wait_ms: .nan}}\n",
     "batching.max_batch_wait_ms must be a number >= 0, got nan"),
    (f"{HUB}batching: {{forward_fills_cores: true}}\n",
     "batching.forward_fills_cores is not a setting"),
], ids=["pooling_mode", "normalise", "prompt", "no-match", "source-key", "batching-value",
        "batching-type", "batching-tokens-bool", "batching-tokens-float",
        "batching-tokens-str", "batching-padding", "pooling", "max_seq_length",
        "max_seq_length-str",
        "bool-str", "remote-code-str", "path-and-hub", "missing-path", "missing-lora",
        "lora-without-adapter", "onnx-lora", "int8-lora", "torch-int8", "option-typo",
        "other-familys-option", "revision-number", "hub-number", "prompt-number",
        "prompt-typo", "lora-list", "task-of-another-family", "description-array",
        "description-alias", "twice", "batching-nan", "batching-registrys-own"])
def test_a_field_that_would_be_ignored_or_fail_every_request_is_refused_at_read(
        tmp_path: Path, body: str, message: str) -> None:
    tasks = "" if body.startswith("tasks:") or "\ntasks:" in body else "tasks: [encode]\n"
    (tmp_path / "bad.yaml").write_text(f"name: me/x\nadapter: transformer\n{tasks}{body}")
    with pytest.raises(CatalogError) as caught:
        load_catalog([tmp_path], check_paths=True)  # as the server's start reads it
    said = str(caught.value)
    assert said.startswith(f"{tmp_path / 'bad.yaml'}: ") and "\n" not in said
    assert message.format(tmp=tmp_path) in said, said


@pytest.mark.parametrize(("weights", "message"), [
    ("{dense: -1}", "got {'dense': -1}"), ("{dense: .nan}", "finite weights >= 0"),
    ("{dense: .inf}", "finite weights >= 0"), ("{dense: a}", "got {'dense': 'a'}"),
    ("{colbert: 1}", "must map output types (dense, sparse, multivector)"), ("{}", "got {}"),
    ("[1, 2]", "got [1, 2]"), ("{dense: 0}", "at least one above 0"),
    ("{dense: 1e-1}", "'1e-1' was read as text: write it as 0.1, or with a dot and a signed "
     "exponent"), ("{dense: 1.0e5}", "'1.0e5' was read as text"),
    ("{dense: 1E-1}", "'1E-1' was read as text"),
    (f"{{dense: {10 ** 400}}}", "finite weights >= 0"),  # an int past float's range
])
def test_m3_score_weights_that_mean_nothing_stop_the_start(tmp_path: Path, weights: str,
                                                          message: str) -> None:
    """Found by a black-box review: these started, then failed every score with a 502."""
    (tmp_path / "bad.yaml").write_text(f"name: me/m3\nadapter: m3\ntasks: [encode, score]\n"
                                       f"{HUB}options: {{score_weights: {weights}}}\n")
    with pytest.raises(CatalogError) as caught:
        load_catalog([tmp_path], check_paths=True)
    said = str(caught.value)
    assert said.startswith(f"{tmp_path / 'bad.yaml'}: options.score_weights must map"), said
    assert message in said, said


def test_m3_score_weights_are_scaled_to_sum_to_one_whatever_their_range() -> None:
    assert m3_score_weights({"dense": 0.4, "sparse": 0.2, "multivector": 0.4}) == \
        pytest.approx({"dense": 0.4, "sparse": 0.2, "multivector": 0.4})
    assert m3_score_weights({"multivector": 3, "dense": 1, "sparse": 0}) == \
        {"dense": 0.25, "multivector": 0.75}  # in output order, zero weights left out
    assert m3_score_weights({"dense": 1e308, "sparse": 1e308}) == {"dense": 0.5, "sparse": 0.5}
    assert m3_score_weights({"dense": 5e-324}) == {"dense": 1.0}
    for bad in ({"dense": True}, {"dense": float("nan")}, {"dense": -0.5, "sparse": 1}):
        with pytest.raises(ValueError, match="must map output types"):
            m3_score_weights(bad)


ALIAS_BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n"
                     for p, c in zip("abcdefghi", "bcdefghij", strict=True))


@pytest.mark.parametrize("make", ["latin-1", "broken link", "a folder", "too large",
                                  "alias bomb", "deep", "fifo", "device", "huge number",
                                  "python tag"])
def test_a_catalog_file_that_cannot_be_read_is_one_line(tmp_path: Path, make: str) -> None:
    """Found by a review of the start: these were tracebacks, not one line and exit 2.
    Found by an operator's review: a kilobyte of nested aliases grew to gigabytes when its
    value was printed, deep nesting was a 3,000-line traceback, a FIFO hung the start and
    a link to /dev/zero (size 0) filled the memory."""
    bad = tmp_path / "bad.yaml"
    if make == "alias bomb":
        bad.write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + ALIAS_BOMB
                       + "name: x\nadapter: synthetic\ntasks: *j\n")
    elif make == "deep":
        bad.write_text("name: x\nadapter: synthetic\ntasks: " + "[" * 5000 + "]" * 5000)
    elif make == "python tag":  # YAML's way to run code as it loads
        bad.write_text("name: !!python/object/apply:os.system ['touch "
                       f"{tmp_path / 'ran'}']\nadapter: synthetic\ntasks: [encode]\n")
    elif make == "huge number":
        bad.write_text("name: x\nadapter: sparse\ntasks: [encode]\nsource: {hub: o/m}\n"
                       "options: {top_k: 1" + "0" * 5000 + "}\n")
    elif make == "fifo":
        os.mkfifo(bad)
    elif make == "device":
        bad.symlink_to("/dev/zero")
    elif make == "latin-1":
        bad.write_bytes("name: caf\u00e9\nadapter: synthetic\ntasks: [encode]\n".encode("latin-1"))
    elif make == "broken link":
        bad.symlink_to(tmp_path / "gone.yaml")
    elif make == "a folder":
        bad.mkdir()
    else:
        bad.write_text("name: x\nadapter: synthetic\ntasks: [encode]\n"
                       + "# padding\n" * 200_000)
    with pytest.raises(CatalogError) as caught:
        load_catalog([tmp_path])
    said = str(caught.value)
    assert said.startswith(f"{bad}: ") and "\n" not in said
    assert {"latin-1": "not UTF-8", "broken link": "not a regular file",
            "a folder": "not a regular file", "too large": "over the 1,048,576 bytes",
            "alias bomb": "an alias (*name)", "deep": "nested too deeply",
            "fifo": "not a regular file", "device": "not a regular file",
            "huge number": "not valid YAML (Exceeds the limit",
            "python tag": "not valid YAML (could not determine a constructor"}[make] in said
    assert not (tmp_path / "ran").exists()


def test_a_path_gone_since_the_start_fails_its_model_not_the_catalog(tmp_path: Path) -> None:
    """A new engine process reads the catalog again: a model folder removed since the
    start must fail that model's load, not the engine's start (every model with it)."""
    (tmp_path / "gone.yaml").write_text("name: me/gone\nadapter: transformer\n"
                                        "tasks: [encode]\nsource: {path: ./absent}\n")
    assert "me/gone" in load_catalog([tmp_path])


def test_every_field_the_shipped_catalog_uses_is_accepted() -> None:
    import yaml

    from ember.config import BUILTIN_CATALOG, SPEC_FIELDS

    used = {key for path in BUILTIN_CATALOG.glob("*.yaml")
            for key in yaml.safe_load(path.read_text(encoding="utf-8"))}
    assert used <= set(SPEC_FIELDS)
    assert len(load_catalog()) == len(list(BUILTIN_CATALOG.glob("*.yaml")))


def test_a_gliner_threshold_out_of_range_fails_its_load_naming_the_yaml_field(
        tmp_path: Path) -> None:
    """Not a 422 blaming each request's params.threshold, which the client never sent."""
    from ember.adapters.base import Runtime
    from ember.adapters.gliner import load_front
    from ember.errors import ModelLoadError
    from tests.adapters.test_gliner import build_gliner

    build_gliner(tmp_path / "model")
    for threshold in ("2", "-0.1", "high", "true"):
        (tmp_path / "gliner.yaml").write_text(
            "name: me/gliner\nadapter: gliner\nsource: {path: model}\ntasks: [extract]\n"
            f"options: {{threshold: {threshold}}}\n")
        with pytest.raises(CatalogError, match=r"options\.threshold must be a number from "
                                               r"0 to 1"):  # at the start, since a review
            load_catalog([tmp_path])
        spec = parse_spec({"name": "me/gliner", "adapter": "gliner", "tasks": ["extract"],
                           "source": {"path": "model"}}, "built", tmp_path)
        spec = replace(spec, options={"threshold": threshold})  # a spec built in code
        with pytest.raises(ModelLoadError, match=r"options\.threshold .* between 0 and 1"):
            load_front(spec, Runtime(backend="torch"))
    (tmp_path / "gliner.yaml").write_text(
        "name: me/gliner\nadapter: gliner\nsource: {path: model}\ntasks: [extract]\n"
        "options: {threshold: 0.3}\n")
    front = load_front(load_catalog([tmp_path])["me/gliner"], Runtime(backend="torch"))
    assert front.threshold == 0.3


def test_a_missing_model_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="does not exist"):
        load_catalog([tmp_path / "nowhere"])


def test_a_named_model_directory_is_served_with_its_family_detected(tmp_path: Path) -> None:
    from tests.adapters.tiny_models import build_bi_encoder, build_cross_encoder

    encoder = build_bi_encoder(tmp_path / "enc")
    ranker = build_cross_encoder(tmp_path / "rank")
    spacy_dir = resolve_source(load_catalog()["spacy/en_core_web_sm"])
    spacy_model = next(p.parent for p in spacy_dir.rglob("meta.json")
                       if (p.parent / "config.cfg").is_file())
    catalog = load_catalog(model_paths=[encoder, ranker, spacy_model])
    assert catalog["local/enc"].adapter == "transformer"
    assert catalog["local/enc"].tasks == ("encode", "score")
    assert catalog["local/rank"].adapter == "cross_encoder"
    assert catalog[f"local/{spacy_model.name}"].adapter == "spacy"
    assert catalog["local/enc"].source.path == encoder.resolve()


def test_two_models_named_alike_are_refused_before_anything_downloads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a black-box review: one repository at two revisions, or two folders of
    one name, gave one catalog entry, the other silently dropped."""
    from tests.adapters.tiny_models import build_bi_encoder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be fetched on the way
    with pytest.raises(CatalogError, match=r"^org/tiny@v2 and org/tiny both name the model "
                       r"'org/tiny'; keep one$"):
        load_catalog(model_paths=["org/tiny@v2", "org/tiny"])
    first = build_bi_encoder(tmp_path / "a" / "model")
    second = build_bi_encoder(tmp_path / "b" / "model", seed=5)
    with pytest.raises(CatalogError, match=r"both name the model 'local/model' \(a folder is "
                       r"served as local/<its name>\); keep one"):
        load_catalog(model_paths=[first, second])
    monkeypatch.chdir(tmp_path)
    for again in (first, "a/model", "./a/model/"):  # the same folder, twice: fine
        assert "local/model" in load_catalog(model_paths=[first, again])


def test_a_directory_without_a_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="holds no model Ember recognises"):
        load_catalog(model_paths=[tmp_path])


def test_a_models_batching_overrides_the_servers_and_keeps_the_rest(tmp_path: Path) -> None:
    (tmp_path / "slow.yaml").write_text(
        "name: me/slow\nadapter: synthetic\ntasks: [encode]\n"
        "batching: {max_batch_wait_ms: 50}\n")
    catalog = load_catalog([tmp_path])
    server = WorkerConfig(max_batch_items=16, max_batch_wait_ms=10)
    merged = catalog["me/slow"].worker_config(server)
    assert merged.max_batch_wait_ms == 50 and merged.max_batch_items == 16
    assert catalog["ember/synthetic"].worker_config(server) == server


def test_batching_settings_the_engine_no_longer_reads_load_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "old.yaml").write_text(
        "name: me/old\nadapter: synthetic\ntasks: [encode]\n"
        "batching: {coalesce_ms: 4, starvation_ms: 30, max_batch_items: 8}\n")
    with caplog.at_level("WARNING", logger="ember.config"):
        catalog = load_catalog([tmp_path], check_paths=True)  # the start's check
        # The start reads the catalog again, as each engine and API process does: found by
        # a review, each warning was printed twice at start.
        assert load_catalog([tmp_path])["me/old"] == catalog["me/old"]
    assert catalog["me/old"].worker_config(WorkerConfig()).max_batch_items == 8
    warned = [r.getMessage() for r in caplog.records]
    assert sum("batching.coalesce_ms" in m for m in warned) == 1
    assert sum("batching.starvation_ms" in m for m in warned) == 1


# Written from each model card: the prompts (query, document), pooling and token limit.
BGE_QUERY = "Represent this sentence for searching relevant passages: "
E5 = {"query": "query: ", "document": "passage: "}
MODEL_CARDS: dict[str, tuple[str, dict[str, str], str | None, int | None]] = {
    "BAAI/bge-small-en-v1.5": ("transformer", {"query": BGE_QUERY}, "cls", 512),
    "BAAI/bge-base-en-v1.5": ("transformer", {"query": BGE_QUERY}, "cls", 512),
    "BAAI/bge-large-en-v1.5": ("transformer", {"query": BGE_QUERY}, "cls", 512),
    "intfloat/e5-small-v2": ("transformer", E5, "mean", 512),
    "intfloat/e5-base-v2": ("transformer", E5, "mean", 512),
    "intfloat/e5-large-v2": ("transformer", E5, "mean", 512),
    "intfloat/multilingual-e5-small": ("transformer", E5, "mean", 512),
    "intfloat/multilingual-e5-base": ("transformer", E5, "mean", 512),
    "intfloat/multilingual-e5-large": ("transformer", E5, "mean", 512),
    "thenlper/gte-small": ("transformer", {}, "mean", 512),
    "thenlper/gte-base": ("transformer", {}, "mean", 512),
    "thenlper/gte-large": ("transformer", {}, "mean", 512),
    "mixedbread-ai/mxbai-embed-large-v1": ("transformer", {"query": BGE_QUERY}, "cls", 512),
    "sentence-transformers/all-mpnet-base-v2": ("transformer", {}, "mean", 384),
    "sentence-transformers/multi-qa-MiniLM-L6-cos-v1": ("transformer", {}, "mean", 512),
    "cross-encoder/ms-marco-MiniLM-L-6-v2": ("cross_encoder", {}, None, 512),
    "BAAI/bge-reranker-base": ("cross_encoder", {}, None, 512),
    "BAAI/bge-reranker-v2-m3": ("cross_encoder", {}, None, 512),
    "naver/splade-cocondenser-ensembledistil": ("sparse", {}, None, 512),
    "colbert-ir/colbertv2.0": ("multivector", {}, None, 512),
    "BAAI/bge-m3": ("m3", {}, None, 8192),
    "answerdotai/answerai-colbert-small-v1": ("multivector", {}, None, 512),
    "urchade/gliner_small-v2.1": ("gliner", {}, None, None),
    "urchade/gliner_medium-v2.1": ("gliner", {}, None, None),
}


def test_every_catalog_entry_parses_names_a_revision_and_follows_its_model_card() -> None:
    import re

    from ember.config import BUILTIN_CATALOG, load_spec_file

    specs = {spec.name: spec for spec in map(load_spec_file, BUILTIN_CATALOG.glob("*.yaml"))}
    assert set(MODEL_CARDS) <= set(specs)
    for name, (adapter, prompts, pooling, limit) in MODEL_CARDS.items():
        spec = specs[name]
        assert spec.source.hub == name, name
        assert re.fullmatch(r"[0-9a-f]{40}", spec.source.revision or ""), name
        assert (spec.adapter, dict(spec.prompts), spec.pooling, spec.max_seq_length) == (
            adapter, prompts, pooling, limit), name
        assert spec.description, name
        if adapter == "transformer":
            assert spec.normalize is True and spec.tasks == ("encode", "score"), name
    gliner = [s for s in specs.values() if s.adapter == "gliner"]
    assert gliner and all(s.tasks == ("extract",) for s in gliner)
    # Pickle weights are allowed only where the repository has nothing else, and said so:
    # GLiNER's weights and BGE-M3's heads.
    assert {s.name for s in specs.values() if s.allow_pickle} == {
        s.name for s in specs.values() if s.adapter in ("gliner", "m3")}
    assert not any(s.trust_remote_code for s in specs.values())


def test_a_hub_id_given_as_a_model_keeps_the_curated_settings_at_its_revision() -> None:
    from ember.config import spec_for_model

    catalog = load_catalog()
    spec = spec_for_model("BAAI/bge-small-en-v1.5@" + "a" * 40, catalog)
    assert spec.source.hub == "BAAI/bge-small-en-v1.5" and spec.source.revision == "a" * 40
    assert spec.prompts == catalog["BAAI/bge-small-en-v1.5"].prompts
    packaged = spec_for_model("sentence-transformers/all-MiniLM-L6-v2", catalog)
    assert packaged.source.hub == "sentence-transformers/all-MiniLM-L6-v2"
    assert packaged.source.package is None and packaged.pooling == "mean"


def test_a_model_that_is_neither_a_folder_nor_a_hub_id_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"does not exist, and .* is not a Hub id"):
        load_catalog(model_paths=[tmp_path / "nowhere" / "deeper" / "still"])
    # The catalog's own names of folders are never Hub ids (org "local").
    with pytest.raises(CatalogError, match=r"does not exist, and 'local/gone' is not a Hub id"):
        load_catalog(model_paths=["local/gone"])


def test_a_hub_model_missing_offline_is_a_one_line_error(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CatalogError) as caught:
        load_catalog(model_paths=["nobody/nothing"])
    message = str(caught.value)
    assert "\n" not in message and "nobody/nothing" in message and "HF_HUB_OFFLINE" in message


def test_sparse_and_colbert_directories_are_their_families(tmp_path: Path) -> None:
    from tests.adapters.tiny_models import build_colbert, build_sparse_encoder

    catalog = load_catalog(model_paths=[build_colbert(tmp_path / "colbert"),
                                        build_sparse_encoder(tmp_path / "splade")])
    assert catalog["local/colbert"].adapter == "multivector"  # not a dense encoder
    assert catalog["local/splade"].adapter == "sparse"
    assert catalog["local/colbert"].tasks == catalog["local/splade"].tasks == ("encode", "score")


def test_a_clip_or_siglip_directory_is_the_clip_family(tmp_path: Path) -> None:
    from tests.adapters.tiny_clip import build_clip, build_siglip

    catalog = load_catalog(model_paths=[build_clip(tmp_path / "clip"),
                                        build_siglip(tmp_path / "siglip")])
    for name in ("local/clip", "local/siglip"):
        assert catalog[name].adapter == "clip"
        assert catalog[name].tasks == ("encode", "score")
    assert FAMILY_OUTPUTS["clip"] == ("dense",)


@pytest.mark.parametrize(("adapter", "task", "options"), [
    ("cross_encoder", "score", "{activaton: none}"), ("gliner", "extract", "{treshold: 0.4}"),
    ("spacy", "extract", "{ner: false}"), ("sparse", "encode", "{topk: 5}"),
    ("cross_encoder", "score", "{dims: 384}")])  # a bi-encoder's option, not a reranker's
def test_each_familys_options_are_its_own(tmp_path: Path, adapter: str, task: str,
                                          options: str) -> None:
    (tmp_path / "bad.yaml").write_text(f"name: me/x\nadapter: {adapter}\ntasks: [{task}]\n"
                                       f"{HUB}options: {options}\n")
    with pytest.raises(CatalogError, match=r"bad\.yaml: unknown field options\."):
        load_catalog([tmp_path])


@pytest.mark.parametrize(("adapter", "task", "option", "says"), [
    ("transformer", "encode", 'dims: "384"', "options.dims must be a whole number >= 1, "
                                             "got '384'"),
    ("transformer", "encode", "dims: 0", "options.dims must be a whole number >= 1"),
    ("transformer", "encode", "embeddings_side: querry", "options.embeddings_side must be "
                                                         "one of query, document"),
    ("transformer", "encode", "embeddings_side: Query", "options.embeddings_side must be "
                                                        "one of query, document"),
    ("sparse", "encode", "threshold: .inf", "options.threshold must be a number >= 0"),
    ("gliner", "extract", 'flat_ner: "false"', "options.flat_ner must be true or false"),
    ("gliner", "extract", "multi_label: 1", "options.multi_label must be true or false"),
    ("gliner", "extract", "labels: person", "options.labels must be a list of texts"),
    ("gliner", "extract", "labels: [person, 3]", "options.labels must be a list of texts"),
    ("spacy", "extract", "ner_only: 'no'", "options.ner_only must be true or false"),
    ("sparse", "encode", "top_k: 2.5", "options.top_k must be a whole number >= 1"),
    ("sparse", "encode", "threshold: -1", "options.threshold must be a number >= 0"),
    ("cross_encoder", "score", "activation: softmax", "options.activation must be one of "
                                                      "sigmoid, none"),
    ("multivector", "encode", "projection: ''", "options.projection must be a non-empty text"),
    ("synthetic", "encode", "overhead_ms: fast", "options.overhead_ms must be a number >= 0"),
    ("synthetic", "encode", "dims: {a: [1, 2]}", "got an object"),
    # Found by a review of the checks: past float's range the check itself raised.
    ("sparse", "encode", "threshold: 1" + "0" * 400, "options.threshold must be a number"),
])
def test_an_options_value_the_family_cannot_read_stops_the_start(
        tmp_path: Path, adapter: str, task: str, option: str, says: str) -> None:
    """Found by an operator's review: option values were read only at the load, so a bad
    one left the server unready (dims "384"), or was read wrongly without a word (a
    misspelt side served the document side, bool("false") turned flat_ner on, a label
    string iterated by letter)."""
    (tmp_path / "bad.yaml").write_text(f"name: me/x\nadapter: {adapter}\ntasks: [{task}]\n"
                                       f"{HUB}options: {{{option}}}\n")
    with pytest.raises(CatalogError, match=r"bad\.yaml: ") as caught:
        load_catalog([tmp_path])
    assert says in str(caught.value)


def test_options_of_the_right_kinds_load(tmp_path: Path) -> None:
    for adapter, task, options in [
            ("transformer", "encode", "{dims: 384, embeddings_side: query}"),
            ("transformer", "encode", "{dims: null, embeddings_side: passage}"),
            ("sparse", "encode", "{top_k: null}"),
            ("gliner", "extract", "{labels: [person, place], flat_ner: false, threshold: 1}"),
            ("sparse", "encode", "{top_k: 5, threshold: 0.5}"),
            ("cross_encoder", "score", "{activation: Sigmoid}")]:
        (tmp_path / "ok.yaml").write_text(f"name: me/x\nadapter: {adapter}\ntasks: [{task}]\n"
                                          f"{HUB}options: {options}\n")
        assert load_catalog([tmp_path])["me/x"].adapter == adapter


@pytest.mark.parametrize("name", ["''", "' me/x'", "'me/x '", '"me/\\nx"', '"me/\\tx"'])
def test_a_model_name_that_is_not_plain_printable_text_is_refused(tmp_path: Path,
                                                                  name: str) -> None:
    """Found by an operator's review: an empty name, one with spaces at its ends or a line
    break was accepted (a request could not name it; a log line could be forged)."""
    (tmp_path / "bad.yaml").write_text(f"name: {name}\nadapter: synthetic\ntasks: [encode]\n")
    with pytest.raises(CatalogError, match=r"must be printable text without spaces"):
        load_catalog([tmp_path])


def test_two_files_of_one_folder_naming_one_model_are_refused(tmp_path: Path) -> None:
    """Found by a review of the start: the later file won without a word. (A later folder
    still replaces a model of an earlier one: that is how a user overrides a default.)"""
    entry = "name: my/dup\nadapter: synthetic\ntasks: [encode]\n"
    (tmp_path / "a.yaml").write_text(entry)
    (tmp_path / "b.yml").write_text(entry)
    with pytest.raises(CatalogError, match=r"a\.yaml and .*b\.yml both name the model 'my/dup'"):
        load_catalog([tmp_path])


def test_a_model_dir_may_start_with_a_tilde(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.yaml").write_text("name: my/m\nadapter: synthetic\n"
                                                "tasks: [encode]\n")
    assert "my/m" in load_catalog([Path("~/models")])
    (tmp_path / "file").write_text("")
    with pytest.raises(CatalogError, match="is a file"):
        load_catalog([tmp_path / "file"])


def test_the_starts_read_says_what_each_folder_gave_and_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found by an operator's review: a YAML that replaced a catalog entry, or a file the
    read skipped for its name's case, went without a word."""
    (tmp_path / "mine.yaml").write_text("name: sentence-transformers/all-MiniLM-L6-v2\n"
                                        "adapter: synthetic\ntasks: [encode]\n")
    (tmp_path / "other.YAML").write_text("name: me/x\nadapter: synthetic\ntasks: [encode]\n")
    with caplog.at_level("INFO", logger="ember.config"):
        catalog = load_catalog([tmp_path], check_paths=True)
    said = [record.getMessage() for record in caplog.records]
    assert catalog["sentence-transformers/all-MiniLM-L6-v2"].adapter == "synthetic"
    assert any(line.startswith(f"{tmp_path / 'mine.yaml'} replaces the model "
                               "sentence-transformers/all-MiniLM-L6-v2 of ")
               for line in said), said
    assert f"model directory {tmp_path}: 1 model file" in said
    assert f"{tmp_path / 'other.YAML'} is not read: model files end in .yaml or .yml" in said
    assert "me/x" not in catalog
    caplog.clear()
    load_catalog([tmp_path])  # every later read (each process's) says nothing
    assert not caplog.records
