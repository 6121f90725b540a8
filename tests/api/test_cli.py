"""`ember serve` flags and EMBER_* variables, `ember models`, and --help."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember import __version__
from ember.cli import WORKER_FLAGS, build_parser, env_name, main, settings_from
from ember.config import DEFAULT_MODEL, ServerSettings
from ember.engine import WorkerConfig
from ember.engine.config import FIXED_MAX_BATCH_TOKENS
from ember.engine.policy import MIN_LEARNED_BATCH_TOKENS
from tests.api.conftest import BROKEN, BUSY, SLOW, SPACY, SYNTH
from tests.live_server import REPO, ServerProcess, free_port, server_env

# The flags a user of such a server expects, at least.
REQUIRED_FLAGS = ["host", "port", "model-dir", "preload", "default-model", "device",
                  "max-batch-tokens", "max-batch-items", "max-batch-wait-ms", "max-padding",
                  "idle-coalesce-ms", "max-queue-items", "max-items-per-request", "api-key"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser reads EMBER_* when it is built; start each test without any."""
    import os

    for key in list(os.environ):
        if key.startswith("EMBER_"):
            monkeypatch.delenv(key)


def parse(*argv: str) -> ServerSettings:
    return settings_from(build_parser().parse_args(["serve", *argv]))


def test_defaults_are_the_settings_defaults() -> None:
    assert parse() == ServerSettings()
    assert parse().default_model == DEFAULT_MODEL
    assert parse().worker == WorkerConfig()


def test_every_flag() -> None:
    settings = parse(
        "--host", "0.0.0.0", "--port", "9001", "--model-dir", "/a", "--model-dir", "/b",
        "--preload", SPACY, "--preload", f"{SYNTH},{BUSY}", "--default-model", SYNTH,
        "--device", "cuda:1", "--torch-threads", "3", "--max-batch-tokens", "4096",
        "--max-batch-items", "16", "--max-batch-wait-ms", "7.5", "--max-padding", "1.5",
        "--idle-coalesce-ms", "0", "--max-queue-items", "99", "--max-items-per-request", "8",
        "--max-body-bytes", "1000", "--request-timeout-s", "2.5", "--max-loaded-models", "3",
        "--memory-budget-mb", "512", "--api-key", "k", "--log-level", "warning",
        "--max-text-chars", "500")
    assert settings.host == "0.0.0.0" and settings.port == 9001
    assert settings.model_dirs == (Path("/a"), Path("/b"))
    assert settings.preload == (SPACY, SYNTH, BUSY)
    assert settings.default_model == SYNTH
    assert settings.device == "cuda:1" and settings.torch_threads == 3
    assert settings.worker == WorkerConfig(max_batch_tokens=4096, max_batch_items=16,
                                           max_batch_wait_ms=7.5, max_padding=1.5,
                                           idle_coalesce_ms=0.0, max_queue_items=99)
    assert settings.max_items_per_request == 8 and settings.max_body_bytes == 1000
    assert settings.max_text_chars == 500
    assert settings.request_timeout_s == 2.5 and settings.max_loaded_models == 3
    assert settings.memory_budget_mb == 512
    assert settings.api_key == "k" and settings.log_level == "warning"


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"host": "10.0.0.1", "port": "7000", "model-dir": "/x:/y", "preload": "a,b",
              "default-model": SYNTH, "device": "cuda", "max-batch-tokens": "1024",
              "max-batch-items": "4", "max-batch-wait-ms": "5", "max-padding": "1.2",
              "idle-coalesce-ms": "1", "max-queue-items": "10", "max-items-per-request": "3",
              "api-key": "from-env", "max-body-bytes": "2048"}
    for flag, value in values.items():
        monkeypatch.setenv(env_name(flag), value)
    settings = parse()
    assert settings.host == "10.0.0.1" and settings.port == 7000
    assert settings.model_dirs == (Path("/x"), Path("/y"))
    assert settings.preload == ("a", "b")
    assert settings.default_model == SYNTH and settings.device == "cuda"
    assert settings.worker == WorkerConfig(max_batch_tokens=1024, max_batch_items=4,
                                           max_batch_wait_ms=5, max_padding=1.2,
                                           idle_coalesce_ms=1, max_queue_items=10)
    assert settings.max_items_per_request == 3 and settings.max_body_bytes == 2048
    assert settings.api_key == "from-env"


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_PORT", "7000")
    monkeypatch.setenv("EMBER_PRELOAD", "a,b")
    monkeypatch.setenv("EMBER_MODEL_DIR", "/x:/y")
    settings = parse("--port", "7001", "--preload", "c", "--model-dir", "/z")
    assert settings.port == 7001
    assert settings.preload == ("c",)
    assert settings.model_dirs == (Path("/z"),)


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("EMBER_MAX_BATCH_ITEMS", "lots", "EMBER_MAX_BATCH_ITEMS='lots' is not a valid int"),
    # Found by a black-box review: any word but the true ones, "maybe", read as off.
    ("EMBER_ALLOW_HUB_MODELS", "maybe", "EMBER_ALLOW_HUB_MODELS='maybe' is not one of"),
    # Found by a third review: argparse checks a flag's choices, not its variable's.
    ("EMBER_BACKEND", "TORCH", "EMBER_BACKEND='TORCH' is not one of 'torch', 'onnx'"),
    ("EMBER_TOKEN_IDS", "yes", "EMBER_TOKEN_IDS='yes' is not one of 'refuse', 'model'"),
    ("EMBER_DISPATCH", "bogus", "EMBER_DISPATCH='bogus' is not one of"),
    ("EMBER_PORT", "abc", "EMBER_PORT='abc' is not a valid int"),
    ("EMBER_MAX_BODY_BYTES", "1.5", "EMBER_MAX_BODY_BYTES='1.5' is not a valid int"),
])
def test_a_bad_variable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], variable: str,
                                         value: str, says: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err
    # One line, named by the command the variable is for: a review found the 35-line usage
    # of `ember serve` printed before it.
    assert err.startswith("ember serve: error: ") and err.count("\n") == 1


def test_a_bad_variable_holds_nothing_a_flag_replaces_or_that_does_not_read_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a review of the start: EMBER_PORT=abc stopped `ember models`, `--version`
    and `serve --help`, and `serve --port 8080` too."""
    monkeypatch.setenv("EMBER_PORT", "abc")
    monkeypatch.setenv("EMBER_BACKEND", "TORCH")
    assert build_parser().parse_args(["serve", "--port", "8080", "--backend", "onnx"]).port \
        == 8080
    assert build_parser().parse_args(["models"]).command == "models"
    with pytest.raises(SystemExit) as shown:
        build_parser().parse_args(["serve", "--help"])
    assert shown.value.code == 0 and "'abc'" in capsys.readouterr().out


def test_a_boolean_variable_takes_its_words(monkeypatch: pytest.MonkeyPatch) -> None:
    for word, value in (("Yes", True), ("on", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("EMBER_ALLOW_HUB_MODELS", word)
        assert parse().allow_hub_models is value


def test_ray_flags_without_ray_are_refused_not_ignored(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replicas", "3", "--ray-cpus", "2"]) == 2
    assert ("--replicas, --ray-cpus take effect with --ray only"
            in capsys.readouterr().err)
    assert parse("--ray", "--replicas", "3").ray is not None


def test_a_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse("--port", "eighty")
    assert exit_.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_help_names_every_flag_its_variable_and_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = [a.option_strings[0][2:] for a in serve._actions if a.option_strings[0] != "-h"]
    assert set(REQUIRED_FLAGS) <= set(flags)
    assert {name for name, *_ in WORKER_FLAGS} <= set(flags)
    for flag in flags:
        assert f"--{flag}" in text
        assert f"[{env_name(flag)}]" in text, flag
    compact = text.replace(" ", "")  # argparse may also break lines at hyphens
    assert "(default:8080)" in compact and f"(default:{DEFAULT_MODEL})" in compact


def test_models_lists_the_catalog_with_cache_state_size_and_tasks(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty Hub cache
    assert main(["models"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "TASKS", "CACHED", "SIZE", "STATE", "DIMS"]
    rows = {line.split()[0]: line.split() for line in lines}
    names = [line.split()[0] for line in lines]
    assert names == sorted(names)
    assert {DEFAULT_MODEL, SPACY, SYNTH, "BAAI/bge-small-en-v1.5",
            "urchade/gliner_small-v2.1"} <= set(names)
    minilm = rows[DEFAULT_MODEL]  # packaged: here, with its size; state needs a server
    # no state without a server; its dims from its YAML, as every catalog embedder's
    assert minilm[1:3] == ["encode,score", "yes"] and minilm[4] == "MB" and minilm[-2:] == [
        "-", "384"]
    assert 80 < float(minilm[3]) < 100
    assert rows["BAAI/bge-small-en-v1.5"][1:4] == ["encode,score", "no", "-"]
    assert rows["BAAI/bge-small-en-v1.5"][-1] == "384"
    assert rows["urchade/gliner_small-v2.1"][1] == "extract"
    assert rows[SYNTH][-1] == "64"  # its YAML gives its dims


def test_models_says_a_cached_hub_model_is_here(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete snapshot in the Hub's cache (laid out as huggingface_hub lays it)."""
    from huggingface_hub import constants

    from ember.hub import human_bytes
    from tests.hub_standin import minilm_folder

    sha = "b" * 40
    repo = tmp_path / "models--BAAI--bge-small-en-v1.5"
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (snapshot / name).symlink_to(minilm_folder() / name)
    (tmp_path / "pins").mkdir()
    pinned = tmp_path / "pins" / "bge.yaml"
    pinned.write_text("name: BAAI/bge-small-en-v1.5\nadapter: transformer\n"
                      "tasks: [encode]\nsource: {hub: BAAI/bge-small-en-v1.5}\n")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert main(["models", "--model-dir", str(tmp_path / "pins")]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    size = sum((minilm_folder() / n).stat().st_size
               for n in ("config.json", "model.safetensors", "tokenizer.json"))
    assert rows["BAAI/bge-small-en-v1.5"][2:5] == ["yes", *human_bytes(size).split()]
    (snapshot / "model.safetensors").unlink()  # weights gone: not cached any more
    assert main(["models", "--model-dir", str(tmp_path / "pins")]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["BAAI/bge-small-en-v1.5"][2:4] == ["no", "-"]


def test_models_asks_a_running_server(live_server: ServerProcess,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--url", live_server.url]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows[DEFAULT_MODEL][:3] == [DEFAULT_MODEL, "encode,score", "yes"]
    assert rows[DEFAULT_MODEL][-2:] == ["loaded", "384"]
    assert rows[SPACY][-2] in ("available", "loaded")
    # Found by a review: a model of the server's --model-dir, unknown here, showed "-".
    served = {m["id"]: m for m in httpx.get(f"{live_server.url}/v1/models").json()["data"]}
    assert served[BROKEN]["cached"] is True and rows[BROKEN][2] == "yes"
    assert served[SLOW]["cached"] is None and rows[SLOW][2] == "-"


def test_models_with_an_extra_folder(model_dir: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["models", "--model-dir", str(model_dir)]) == 0
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {SLOW, BUSY, DEFAULT_MODEL} <= names
    # Found by a review of the start: `ember models` ignored EMBER_MODEL_DIR, which
    # `ember serve` reads, and listed another catalog.
    monkeypatch.setenv("EMBER_MODEL_DIR", str(model_dir))
    assert main(["models"]) == 0
    assert {SLOW, BUSY} <= {line.split()[0] for line in capsys.readouterr().out.splitlines()}


def test_models_with_a_missing_folder_is_exit_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--model-dir", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_models_with_a_broken_yaml_names_the_file(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text("name: x\nadapter: nope\ntasks: [encode]\n")
    assert main(["models", "--model-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "adapter" in err


def run_ember(*argv: str, module: str = "ember.cli", env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                          text=True, env=server_env(env), cwd=REPO, timeout=120)


def test_serve_refuses_an_unknown_default_model() -> None:
    result = run_ember("serve", "--default-model", "no/such-model", "--port", "1")
    assert result.returncode == 2, result
    assert "no/such-model" in result.stderr and SYNTH in result.stderr


def test_a_default_model_neither_on_the_hub_nor_in_the_catalog_says_why_first() -> None:
    """Found by a black-box review: the Hub's reason came after the catalog's 26 names."""
    result = run_ember("serve", "--default-model", "BAAI/bge-small-en-v1.6", "--port", "1")
    assert result.returncode == 2, result
    line = result.stderr.strip().splitlines()[-1]
    assert line.index("not in the Hugging Face cache") < line.index("known: ")
    assert "did you mean 'BAAI/bge-small-en-v1.5'?" in line


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("ember")
    assert script.exists(), "pip install -e . installs the `ember` command"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True,
                            env=server_env(), timeout=60)
    assert result.returncode == 0
    assert "serve" in result.stdout and "models" in result.stdout


def test_hub_ids_in_model_default_model_and_preload_and_allow_hub_models() -> None:
    settings = parse("--model", "BAAI/bge-small-en-v1.5@main", "--default-model",
                     "org/default", "--preload", "org/other", "--allow-hub-models")
    assert settings.model_paths == (Path("BAAI/bge-small-en-v1.5@main"),)
    assert settings.default_model == "org/default" and settings.preload == ("org/other",)
    assert settings.allow_hub_models is True
    assert parse().allow_hub_models is False


def test_hub_ids_of_the_default_and_preloads_join_the_models_every_process_loads() -> None:
    from ember.config import load_catalog, with_hub_models

    settings = with_hub_models(parse("--default-model", "org/default", "--preload",
                                     f"org/other,{SPACY}"), load_catalog())
    assert settings.model_paths == (Path("org/default"), Path("org/other"))


def test_a_folder_is_a_default_or_preload_by_its_path_or_its_local_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a black-box review: `--model /d/m3 --default-model local/m3` read local/m3
    as a Hub id that clashed with the folder, and `--default-model /d/m3` was not in the
    catalog; a folder could be the default model only through a YAML."""
    from ember.config import load_catalog, with_hub_models

    first, second = tmp_path / "m3", tmp_path / "other"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(tmp_path)
    known = load_catalog()
    by_name = with_hub_models(parse("--model", str(first), "--default-model", "local/m3"),
                              known)
    assert (by_name.default_model, by_name.model_paths) == ("local/m3", (first,))
    by_path = with_hub_models(parse("--default-model", "./m3", "--preload",
                                    f"{second},org/hub,{SPACY}"), known)
    assert by_path.default_model == "local/m3"
    assert by_path.preload == ("local/other", "org/hub", SPACY)
    assert by_path.model_paths == (Path("m3"), second, Path("org/hub"))
    named_twice = with_hub_models(parse("--model", str(first), "--default-model", "m3"), known)
    assert (named_twice.default_model, named_twice.model_paths) == ("local/m3", (first,))
    # A local/ name is never a Hub id: a mistyped one is not sent to the Hub as org "local".
    typo = with_hub_models(parse("--model", str(first), "--default-model", "local/m33"), known)
    assert (typo.default_model, typo.model_paths) == ("local/m33", (first,))


def test_a_relative_folder_that_spells_a_hub_id_is_said_to_win(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The folder is served, the Hub repository neither fetched nor said to be served
    (a review found it downloaded all the same where the catalog has the id)."""
    from ember.cli import prefetch, say_folders_named_as_hub_ids
    from ember.config import load_catalog

    folder = tmp_path / "BAAI" / "bge-small-en-v1.5"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["BertModel"]}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a fetch would fail: not in the cache
    settings = parse("--model", "./BAAI/bge-small-en-v1.5")  # a Path: BAAI/bge-small-en-v1.5
    catalog = load_catalog(model_paths=settings.model_paths)
    assert catalog["local/bge-small-en-v1.5"].source.path == folder
    prefetch(settings, catalog)  # nothing to fetch
    with caplog.at_level("WARNING", logger="ember"):
        say_folders_named_as_hub_ids([*settings.model_paths, "BAAI/bge-small-en-v1.5",
                                      folder, "BAAI/bge-m3"])
    said = (f"BAAI/bge-small-en-v1.5 names the folder {folder} here, served as "
            "local/bge-small-en-v1.5; the Hub repository of that name is not fetched")
    assert [record.getMessage().startswith(said) for record in caplog.records] == [True, True]


def test_a_folder_default_that_holds_no_model_is_named_as_a_folder(tmp_path: Path) -> None:
    """Found by a review: the refusal called the folder's local/ name a Hub id."""
    empty = tmp_path / "bge"
    empty.mkdir()
    result = run_ember("serve", "--default-model", str(empty), "--port", "1")
    assert result.returncode == 2, result
    assert "holds no model Ember recognises" in result.stderr, result.stderr
    assert "as a Hub id" not in result.stderr, result.stderr
    result = run_ember("serve", "--default-model", "local/nothing", "--port", "1")
    assert result.returncode == 2, result
    assert "default model 'local/nothing' is not in the catalog" in result.stderr, \
        result.stderr


def test_model_names_local_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse("--model", "/m/a", "--model", "/m/b").model_paths == (Path("/m/a"),
                                                                      Path("/m/b"))
    monkeypatch.setenv("EMBER_MODEL", "/m/c:/m/d")
    assert parse().model_paths == (Path("/m/c"), Path("/m/d"))



def test_version() -> None:
    result = run_ember("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"ember {__version__}"


def test_flags_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model-d", "/x"])
    assert "unrecognized arguments: --model-d" in capsys.readouterr().err


def test_a_bad_log_level_is_one_line() -> None:
    result = run_ember("serve", "--log-level", "loud", "--port", "1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ember: --log-level must be one of debug, info, warning, error, not 'loud'"]


@pytest.mark.parametrize(("flags", "says"), [
    (("--port", "70000"), "--port must be 0-65535, got 70000"),
    (("--device", "tpu"), "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (("--max-body-bytes", "0"), "--max-body-bytes must be 1 or more, got 0"),
    (("--max-loaded-models", "0"), "--max-loaded-models must be 1 or more, got 0"),
    (("--request-timeout-s", "-1"), "--request-timeout-s must be over 0"),
    (("--max-text-chars", "0"), "--max-text-chars must be 1 or more, got 0"),
    (("--torch-threads", "-3"), "--torch-threads must be 1 or more"),
    (("--onnx-threads", "0"), "--onnx-threads must be 1 or more"),
    (("--max-loaded-models", "2", "--preload", f"{BUSY},{SLOW}"),
     "--preload and the default model name 3 models, and --max-loaded-models keeps 2"),
    # Found by a review of the start: an empty host listened on every interface, and an
    # empty default model was read as the current folder.
    (("--host", ""), "--host is empty (an unset EMBER_HOST?)"),
    (("--forwarded-allow-ips", "10.0.0.1/8"), "--forwarded-allow-ips '10.0.0.1/8' is not an "
     "IP address or network (10.0.0.5, 10.0.0.0/8, or * for any); did you mean 10.0.0.0/8?"),
    (("--forwarded-allow-ips", "127.0.0.1,garbage"), "--forwarded-allow-ips 'garbage' is not"),
    (("--default-model", " "), "--default-model is empty"),
])
def test_a_setting_that_would_fail_every_request_is_refused_at_start(
        flags: tuple[str, ...], says: str) -> None:
    """Found by a black-box review: these started, answered /readyz 200, then refused
    every request (a bad deploy that looks alive)."""
    result = run_ember("serve", "--default-model", SYNTH, *flags)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ember: {says}"), lines


@pytest.mark.skipif(bool(importlib.util.find_spec("torch")) and __import__(
    "torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_on_a_machine_without_one_is_refused_at_start() -> None:
    result = run_ember("serve", "--default-model", SYNTH, "--device", "cuda", "--port", "1")
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "--device cuda" in errors[0] and "--device cpu" in errors[0]


@pytest.mark.parametrize("mode", [[], ["--ray"]], ids=["one-process", "ray"])
def test_a_taken_port_is_one_line_and_exit_1(mode: list[str]) -> None:
    """(`--workers N`: tests/test_supervisor.py.) Under --ray, before Ray starts."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        result = run_ember("serve", "--port", str(port), "--default-model", SYNTH, *mode)
    assert result.returncode == 1, result
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0]
    assert "Traceback" not in result.stderr and "listening" not in result.stderr
    assert "Ray cluster at" not in result.stderr


def test_a_limit_of_one_loaded_model_is_a_warning_at_start() -> None:
    """Found by a black-box review: with --max-loaded-models 1 every other model loaded
    and left again on each request, with nothing said at start."""
    port = free_port()
    with socket.socket() as taken:  # the start stops at the port, after its checks
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        result = run_ember("serve", "--port", str(port), "--default-model", SYNTH,
                           "--max-loaded-models", "1")
    assert result.returncode == 1, result
    assert "--max-loaded-models 1 holds the default model alone" in result.stderr


def test_listening_is_said_once_the_port_is_bound(live_server: ServerProcess) -> None:
    lines = [line for line in live_server.log_text().splitlines() if "listening on" in line]
    assert len(lines) == 1 and f"http://127.0.0.1:{live_server.port}" in lines[0]


def test_dispatch_is_auto_unless_fixed_and_unset_windows_stay_unset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse().worker.dispatch == "auto"
    assert parse().worker.max_batch_wait_ms is None  # learned
    assert parse("--dispatch", "fixed").worker == WorkerConfig(dispatch="fixed")
    monkeypatch.setenv("EMBER_DISPATCH", "fixed")
    assert parse().worker.dispatch == "fixed"
    with pytest.raises(SystemExit):
        parse("--dispatch", "sometimes")


@pytest.mark.parametrize(("field", "says"), [
    ("normalise: false", "unknown field normalise (did you mean normalize?)"),
    ("batching: {max_batch_tokens: 0}", "batching.max_batch_tokens must be >= 1, got 0"),
    ("source: {path: /nonexistent/weights}", "source.path /nonexistent/weights does not exist"),
])
def test_a_model_yaml_that_would_fail_every_request_is_refused_at_start(
        tmp_path: Path, field: str, says: str) -> None:
    """Found by a black-box review: a misspelt field was ignored, a bad value passed the
    start and then failed every request (the same value as a flag stops the start)."""
    source = "" if field.startswith("source:") else "source: {hub: org/tiny}\n"
    (tmp_path / "mine.yaml").write_text(
        f"name: me/mine\nadapter: transformer\ntasks: [encode]\n{source}{field}\n")
    result = run_ember("serve", "--model-dir", str(tmp_path), "--default-model", SYNTH,
                       "--port", "1")
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{tmp_path / 'mine.yaml'}: {says}" in lines[0], lines


def test_cors_origins_from_flags_or_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse().cors_origins == ()
    assert parse("--cors-allow-origin", "https://a.example",
                 "--cors-allow-origin", "http://localhost:3000").cors_origins == (
        "https://a.example", "http://localhost:3000")
    monkeypatch.setenv(env_name("cors-allow-origin"), "https://a.example, *")
    assert parse().cors_origins == ("https://a.example", "*")


@pytest.mark.parametrize("origin", ["https://a.example/", "a.example", "https://a.example/app",
                                    "ftp://a.example", "https://*.example.com",
                                    "https://a.example:abc"])
def test_a_cors_origin_with_a_path_or_no_scheme_is_refused(origin: str) -> None:
    with pytest.raises(ValueError, match="is not an origin: give scheme://host"):
        parse("--cors-allow-origin", origin)


@pytest.mark.parametrize(("origin", "sent"), [("https://App.Example.com", "https://app.example.com"),
                                              ("https://a.example:443", "https://a.example"),
                                              ("HTTP://localhost:80", "http://localhost")])
def test_a_cors_origin_no_browser_sends_is_told_the_one_it_does(origin: str, sent: str) -> None:
    """Found by a code review: accepted, and then no page ever matched it (browsers send
    the host in lower case and leave the default port out)."""
    with pytest.raises(ValueError, match=f"never what a browser sends; give '{sent}'"):
        parse("--cors-allow-origin", origin)


@pytest.mark.parametrize(("argv", "hint"), [
    (["serve", "--max-loaded", "2"], "--max-loaded (did you mean --max-loaded-models?)"),
    (["serve", "--defaultmodel", "x"], "--defaultmodel (did you mean --default-model?)"),
    (["serve", "--api_key=k"], "--api_key (did you mean --api-key?)"),
    # Found by a code review: "--port (did you mean --port?)", another command's flag.
    (["models", "--port", "9000"], "--port is a flag of `ember serve`"),
    (["serve", "--url", "x"], "--url is a flag of `ember models`"),
])
def test_a_mistyped_flag_is_told_the_closest_one(argv: list[str], hint: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a black-box review: a bare "unrecognized arguments", where a YAML field
    gets a suggestion."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert hint in err
    # The command's own usage (found by a fresh-clone walkthrough: the top level's).
    assert err.startswith(f"usage: ember {argv[0]} ") and f"ember {argv[0]}: error:" in err


def test_max_batch_tokens_help_gives_the_learned_budgets_bounds() -> None:
    """Found by a review: the help gave the ceiling, not the floor a noisy fit cannot pass."""
    text = next(help_text for name, _, _, help_text in WORKER_FLAGS
                if name == "max-batch-tokens")
    assert (f"at least {MIN_LEARNED_BATCH_TOKENS} and at most {FIXED_MAX_BATCH_TOKENS}"
            in text)


def test_help_gives_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a black-box review: "(default: every core) [EMBER_ONNX_THREADS]
    (default: None)"."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert "(default: every core) [EMBER_ONNX_THREADS]" in text
    assert "[EMBER_PORT] (default: 8080)" in text
    # A help text that says "defaults" in passing still gets its own (found by a review).
    assert "[EMBER_DISPATCH] (default: auto)" in text
    # Found by a fresh-clone walkthrough: the ONNX default left out, the choices unsaid.
    assert "1 where every model runs on ONNX Runtime" in text
    assert "--log-level {debug,info,warning,error}" in text


def test_help_never_shows_the_api_key(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a code review: EMBER_API_KEY's value was the flag's shown default."""
    monkeypatch.setenv("EMBER_API_KEY", "s3cretKEY")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "s3cretKEY" not in capsys.readouterr().out


def test_python_dash_m_ember_is_the_ember_command() -> None:
    result = run_ember("--version", module="ember")
    assert result.returncode == 0 and result.stdout.strip() == f"ember {__version__}"


def test_forwarded_allow_ips_is_read_and_refused_under_ray() -> None:
    assert parse("--forwarded-allow-ips", "10.0.0.0/8,127.0.0.1").forwarded_allow_ips == \
        "10.0.0.0/8,127.0.0.1"
    with pytest.raises(ValueError, match="under --ray Ray's proxy takes the connections"):
        parse("--ray", "--forwarded-allow-ips", "127.0.0.1")


@pytest.mark.parametrize(("key", "says"), [
    # Found by a black-box review: an empty EMBER_API_KEY (a missing secret) served
    # without a key, saying nothing.
    ("", "is empty"), ("  ", "is empty"),
    # Found by a code review: a key with a newline at its end (a secret read from a file)
    # served, and every request got a 401, the client's header being stripped.
    ("s3cret\n", "use printable ASCII only"), (" s3cret", "use printable ASCII only"),
    ("two words", "use printable ASCII only"), ("cl\u00e9", "use printable ASCII only")])
def test_an_api_key_no_client_can_send_stops_the_start(
        key: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_API_KEY", key)
    with pytest.raises(ValueError, match=f"--api-key \\(or EMBER_API_KEY\\).*{says}"):
        parse()


def start_stopped_at_its_port(*flags: str, env: dict[str, str] | None = None
                              ) -> subprocess.CompletedProcess[str]:
    """`ember serve` run through its start's checks and warnings, then stopped by a port
    that is taken (exit 1), so nothing serves."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        return run_ember("serve", "--port", str(port), "--default-model", SYNTH, *flags,
                         env=env)


def test_more_api_processes_than_cores_is_a_warning() -> None:
    """Found by a review of the start: --workers took any count without a word."""
    result = start_stopped_at_its_port("--workers", "512")
    assert f"--workers 512 is more API processes than this machine's {os.cpu_count()} " \
        "cores" in result.stderr, result.stderr


def test_a_variable_that_misspells_a_setting_is_named_at_start() -> None:
    """Found by a review of the start: EMBER_APIKEY was ignored without a word, and the
    server meant to need a key started open."""
    result = start_stopped_at_its_port(env={"EMBER_APIKEY": "s3cret",
                                            "EMBER_FRAMEWORK": "unrelated"})
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert any("EMBER_APIKEY is not a setting and is ignored; did you mean EMBER_API_KEY?"
               in line for line in warnings), result.stderr
    assert not any("EMBER_FRAMEWORK" in line for line in warnings)  # another tool's


@contextlib.contextmanager
def answering(status: int, content_type: str, body: bytes) -> Iterator[str]:
    """The URL of a local HTTP server that answers every GET with this, while it runs."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_models_of_a_server_that_is_not_embers_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a review of the start: a web page's 200 was a JSONDecodeError traceback."""
    with answering(200, "text/html", b"<html>not a model list</html>") as url:
        assert main(["models", "--url", url]) == 1
        assert "no Ember model list; is it an Ember server?" in capsys.readouterr().err


def test_a_refused_start_under_json_logs_is_a_json_line() -> None:
    """Found by a review of the start: the README says every line on stderr is JSON under
    --log-format json; a refused setting was plain text."""
    result = run_ember("serve", "--port", "99999", "--log-format", "json")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    entry = json.loads(line)
    assert entry["level"] == "error" and entry["message"] == "--port must be 0-65535, got 99999"


def test_models_piped_into_a_reader_that_stops_early_ends_quietly() -> None:
    """Found by a review: `ember models | head -1` ended in a BrokenPipeError traceback."""
    process = subprocess.Popen([sys.executable, "-m", "ember", "models"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=server_env())
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before its first line: the reader is gone (unbuffered output)
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize(("key", "says"), [
    (None, "needs an API key (401); give it with --api-key KEY or EMBER_API_KEY"),
    ("wrong", "refused the API key given (401); check --api-key or EMBER_API_KEY"),
])
def test_models_of_a_server_that_needs_a_key_says_how_to_give_it(
        capsys: pytest.CaptureFixture[str], key: str | None, says: str) -> None:
    """Found by a review: a 401 was httpx's text and a link to developer.mozilla.org."""
    with answering(401, "application/json", b'{"error": "unauthorized"}') as url:
        assert main(["models", "--url", url, *(["--api-key", key] if key else [])]) == 1
        assert capsys.readouterr().err == f"ember: {url} {says}\n"
