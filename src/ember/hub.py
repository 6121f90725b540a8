"""Models named by a Hugging Face Hub id: read from the local cache, or downloaded into it.

Everything goes through `huggingface_hub`, so HF_TOKEN, HF_ENDPOINT, HF_HOME and
HF_HUB_OFFLINE mean what they mean there. Only what a model needs is fetched: safetensors
weights, config and tokenizer files, sentence-transformers module files, and
`onnx/model.onnx` when the ONNX backend would run it. Pickle weights are fetched only for
a model whose YAML allows them, and only when the repository has no safetensors; Python
files only for one that trusts remote code.

A snapshot already complete in the cache is used without any request. One process at a
time fetches a repository (a file lock in the cache), so servers and replicas starting
together download each file once; the others then find it complete. A file cut in the
middle is resumed with a range request (huggingface_hub's own retry); files finished
before an interruption are kept.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ember.errors import described
from ember.model_files import ModelFileError, read_model_json

log = logging.getLogger("ember.hub")

# org/name, optionally @revision (a branch, a tag or a commit sha); as the Hub spells ids.
# A revision is path-like (`refs/pr/1`), never absolute nor with an empty segment: the
# cache keeps it as a file under the repository's `refs/`.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
                    r"(?:@(?P<revision>[\w.-]{1,100}(?:/[\w.-]{1,100}){0,4}))?")
COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
ALLOW_ENV = "EMBER_ALLOW_HUB_MODELS"  # "0": this process may not download (set by serve)
LIMIT_ENV = "EMBER_MAX_DOWNLOAD_GB"  # the largest download a request may start
PROGRESS_EVERY_S = 2.0  # at most one byte-count line per download this often

# Tokenizers' files are among these (tokenizer.json, vocab.txt, spiece.model); a pattern
# as wide as `tokenizer*` fetched tokenizer.py and pickles too.
BASE_FILES = ("*.json", "*.txt", "*.model", "*.safetensors",
              "artifact.metadata")  # a Stanford-NLP ColBERT's settings
PICKLE_FILES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
ONNX_FILES = ("onnx/model.onnx", "onnx/model.onnx_data")
CODE_FILES = ("*.py",)
CONFIG_FILES = ("config.json", "gliner_config.json")  # one of them names the architecture
# A file in a folder is fetched only from a sentence-transformers module's folder
# (1_Pooling/, 2_Dense/) or as the ONNX graph: the patterns' `*` crosses folders, so
# `*.json` took a repository's 3,000 checkpoint and log files.
MODULE_FOLDER = re.compile(r"\d+_[\w.-]+/[^/]+")
MAX_FILES = 256  # a model needs a few dozen files; past this, a repository is refused
# Folders of other runtimes, never read here.
IGNORED = ("openvino/*", "coreml/*", "tf_model*", "flax_model*", "rust_model*", "*.h5",
           "*.msgpack", "*.ot")


class HubError(FileNotFoundError):
    """A Hub model that cannot be had: the message is one line naming it and what to do."""


class NotOnHub(HubError):
    """No such repository (or one the token may not see): an unknown model, not a fault."""


class NotDownloaded(HubError):
    """A model missing from the cache that this process may not download (offline, or not
    named at the start): not on this server, not a fault."""


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


def parse_hub_id(text: str) -> HubRef | None:
    """`org/name[@revision]` as a HubRef; None for anything else (a path, a bad name).
    Exact: a space or a newline around it is no Hub id (a request's name is the catalog's
    key, and "org/x " would load a second copy of org/x), nor is a name the Hub's own
    client refuses (`--`, a `.git` end)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils._validators import validate_repo_id

    match = HUB_ID.fullmatch(text)
    if match is None or ".." in text or text.startswith(("./", "/", "~")):
        return None
    try:
        validate_repo_id(match.group("repo"))
    except HFValidationError:
        return None
    return HubRef(match.group("repo"), match.group("revision"))


@dataclass(frozen=True)
class Wanted:
    """What a model needs from its repository."""

    allow_pickle: bool = False
    trust_remote_code: bool = False
    onnx: bool = False
    weights: bool = True  # False: config and tokenizer only (a GLiNER model's backbone)
    # Files fetched whatever weights the repository has, each group one file the model
    # needs in any of its names: an M3 model's heads, pickled (fetched only where its spec
    # allows pickles: beside safetensors weights, the pickles are not) or safetensors.
    extra_files: tuple[tuple[str, ...], ...] = ()

    def patterns(self, pickle: bool) -> list[str]:
        patterns = [p for p in BASE_FILES if self.weights or p != "*.safetensors"]
        patterns += [name for group in self.extra_files for name in group]
        if pickle:
            patterns += PICKLE_FILES
        if self.onnx:
            patterns += ONNX_FILES
        if self.trust_remote_code:
            patterns += CODE_FILES
        return patterns


def let_requests_download(allowed: bool, max_gb: float = 20.0) -> None:
    """From here on this process, and those it starts, download only what a request may
    name, that only if `allowed` (--allow-hub-models), and at most `max_gb` a model
    (--max-download-gb)."""
    os.environ[ALLOW_ENV] = "1" if allowed else "0"
    os.environ[LIMIT_ENV] = repr(max_gb)


def request_download_limit() -> int | None:
    """Bytes a download that a request starts may take; None: not limited (a library
    caller's process)."""
    try:
        return int(float(os.environ[LIMIT_ENV]) * 1e9)
    except (KeyError, ValueError):
        return None


def requests_may_download() -> bool:
    """Whether a request may name a Hub model the catalog lacks (--allow-hub-models)."""
    return os.environ.get(ALLOW_ENV, "").lower() in ("1", "true", "yes", "on")


def downloads_allowed() -> bool:
    """Whether this process may download: `ember serve` forbids it after its startup
    downloads unless --allow-hub-models; a library caller may."""
    return os.environ.get(ALLOW_ENV, "1").lower() not in ("0", "false", "no", "off")


def may_download() -> bool:
    """Whether a model missing from the cache would be downloaded now."""
    return downloads_allowed() and not offline()


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached(ref: HubRef, wanted: Wanted) -> Path | None:
    """The complete snapshot of `ref` in the cache, found without any request."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    for pickle in ((False, True) if wanted.allow_pickle else (False,)):
        try:
            folder = Path(snapshot_download(ref.repo, revision=ref.revision,
                                            allow_patterns=wanted.patterns(pickle),
                                            ignore_patterns=list(IGNORED),
                                            local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            continue
        configured = any((folder / name).is_file() for name in CONFIG_FILES)
        extras = all(any((folder / name).is_file() for name in group)
                     for group in wanted.extra_files)
        if configured and extras and (not wanted.weights or (
                has_weights(folder, pickle) and shards_here(folder, pickle))):
            return folder
    return None


# A sharded model's weights name their shards here; a download cut between two shards
# leaves a folder that the Hub's client takes as whole where it holds no listing of it.
SHARD_INDEXES = {"model.safetensors.index.json": False, "pytorch_model.bin.index.json": True}


def shards_here(folder: Path, pickle: bool) -> bool:
    """Whether every shard the folder's weight indexes name is in it (a name outside the
    folder, or an index that cannot be read, is not)."""
    for name, pickled in SHARD_INDEXES.items():
        index = folder / name
        if (pickled and not pickle) or not index.is_file():
            continue
        try:
            shards = read_model_json(index).get("weight_map")
        except (ModelFileError, OSError):
            return False
        if not isinstance(shards, dict):
            return False
        for shard in set(shards.values()):
            if not (isinstance(shard, str) and shard == Path(shard).name
                    and not shard.startswith(".") and (folder / shard).is_file()):
                return False
    return True


def has_weights(folder: Path, pickle: bool) -> bool:
    kinds = ("*.safetensors", "onnx/model.onnx", *(PICKLE_FILES if pickle else ()))
    return any(next(folder.glob(kind), None) is not None for kind in kinds)


def snapshot(ref: HubRef, wanted: Wanted, download: bool | None = None,
             exact: bool = True, limit: int | None = None) -> Path:
    """The local folder of `ref`: from the cache, else downloaded (when allowed, and at
    most `limit` bytes). Not `exact`: a cached snapshot without the ONNX graph will do."""
    folder = cached(ref, wanted if exact else replace(wanted, onnx=False))
    if folder is not None:
        return folder
    # Some of its files there (a download cut short) is not the same as none.
    where = ("is incomplete in the Hugging Face cache (a download was cut short?)"
             if (cache_root() / f"models--{ref.repo.replace('/', '--')}").is_dir()
             else "is not in the Hugging Face cache")
    if offline():
        raise NotDownloaded(f"model {ref} {where} ({cache_root()}) and HF_HUB_OFFLINE is "
                            "set; fetch it once online (unset HF_HUB_OFFLINE and start "
                            f"`ember serve --preload {ref}`), or copy the cache here")
    if not (downloads_allowed() if download is None else download):
        raise NotDownloaded(f"model {ref} {where} ({cache_root()}) and this server "
                            "downloads only the models named at its start; name it with "
                            f"--preload {ref}, or start with --allow-hub-models")
    return fetch(ref, wanted, limit)


def fetch(ref: HubRef, wanted: Wanted, limit: int | None = None) -> Path:
    """Download what `ref` needs, one process at a time per repository."""
    from filelock import FileLock

    locks = cache_root() / ".locks" / "ember"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / (ref.repo.replace("/", "--") + ".lock")))
    with lock:
        folder = cached(ref, wanted)  # another process may have fetched it meanwhile
        if folder is not None:
            log.info("%s: found in the cache, fetched by another process", ref)
            return folder
        return _download(ref, wanted, limit)


def _download(ref: HubRef, wanted: Wanted, limit: int | None) -> Path:
    from huggingface_hub import HfApi, snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils._paths import filter_repo_objects

    started = time.monotonic()
    try:
        info = HfApi().model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except RevisionNotFoundError:
        raise HubError(f"model {ref}: the repository has no revision {ref.revision!r}; "
                       "name a branch, a tag or a commit it has") from None
    except RepositoryNotFoundError:
        raise NotOnHub(f"model {ref} is not on the Hub (or needs a token: set HF_TOKEN)"
                       ) from None
    except Exception as exc:  # the client's HTTP errors, and its transport's of any kind
        raise hub_failure(ref, exc, "listing its files") from None
    if info.id and info.id != ref.repo and info.id.lower() == ref.repo.lower():
        # The Hub matches ids in any case, its cache does not: a second spelling would be
        # a second download and a second model in memory.
        raise NotOnHub(f"model {ref} is on the Hub as {info.id!r}: did you mean "
                       f"{info.id!r}? (one spelling, one copy)")
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    if unsafe := sorted(name for name in sizes if not _inside(name)):
        raise HubError(f"model {ref}: the repository lists files outside itself "
                       f"({', '.join(map(repr, unsafe[:3]))}); refused, nothing downloaded")
    has_safetensors = any(name.endswith(".safetensors") for name in sizes)
    pickled = [n for n in sizes if any(_match(n, p) for p in PICKLE_FILES)]
    if not wanted.weights:
        has_safetensors, pickled = True, []
    if not has_safetensors and pickled and not wanted.allow_pickle:
        raise HubError(f"model {ref} has pickle weights only ({', '.join(sorted(pickled))}); "
                       "Ember loads safetensors unless the model's YAML says "
                       "allow_pickle: true (pickle files can run code when loaded)")
    pickle = not has_safetensors and wanted.allow_pickle
    if not has_safetensors and not pickled and not (wanted.onnx and "onnx/model.onnx" in sizes):
        raise HubError(f"model {ref} has no weights Ember can load (no *.safetensors)")
    patterns = wanted.patterns(pickle)
    files = [name for name in filter_repo_objects(list(sizes), allow_patterns=patterns,
                                                  ignore_patterns=list(IGNORED))
             if "/" not in name or name in ONNX_FILES or MODULE_FOLDER.fullmatch(name)]
    if len(files) > MAX_FILES:
        raise HubError(f"model {ref}: the repository has {len(files):,} files a model would "
                       f"read, over the {MAX_FILES} Ember fetches; refused, nothing "
                       "downloaded")
    sha = str(info.sha)
    if not COMMIT_SHA.fullmatch(sha):  # it names a folder in the cache
        raise HubError(f"model {ref}: the Hub answered {described(sha)} as its commit, not a "
                       "commit id; refused, nothing downloaded")
    missing = [f for f in files
               if not isinstance(try_to_load_from_cache(ref.repo, f, revision=sha), str)]
    total = sum(sizes[f] for f in missing)
    if limit is not None and total > limit:
        raise HubError(f"model {ref} would download {human_bytes(total)}, over the "
                       f"{human_bytes(limit)} a request may start (--max-download-gb); name "
                       f"it at the start (--preload {ref}) to fetch it")
    log.info("%s: downloading %d of %d files (%s) at revision %s", ref, len(missing),
             len(files), human_bytes(total), sha)
    for name in missing:
        log.info("%s: downloading %s (%s)", ref, name, human_bytes(sizes[name]))
    try:
        # At the commit listed and judged: a branch moved meanwhile would bring other files.
        folder = snapshot_download(ref.repo, revision=sha,
                                   allow_patterns=[glob.escape(name) for name in files],
                                   tqdm_class=progress_class(str(ref)))
    except ValueError as exc:  # the client's own checks of what the Hub answered
        raise HubError(f"model {ref}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # a file the Hub failed, or the network: the others are kept
        raise hub_failure(ref, exc, "downloading its files") from None
    remember_revision(Path(folder), ref.revision or "main", sha)
    log.info("%s: downloaded %s in %.1f s", ref, human_bytes(total),
             time.monotonic() - started)
    return Path(folder)


def remember_revision(folder: Path, revision: str, sha: str) -> None:
    """Point the cache's `revision` at `sha`, as the Hub's client does when it downloads
    by a branch or tag, so that a later offline lookup by that name finds this snapshot."""
    refs = folder.parent.parent / "refs"
    ref_file = refs / revision
    if not ref_file.resolve().is_relative_to(refs.resolve()):
        raise HubError(f"revision {revision!r} names a place outside the cache; refused")
    try:
        if revision == sha or (ref_file.is_file() and ref_file.read_text() == sha):
            return  # as the Hub's client: a read-only cache that has it stays usable
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        written = ref_file.with_name(f".{ref_file.name}.{os.getpid()}.tmp")
        written.write_text(sha)
        written.replace(ref_file)  # whole or not at all: another process may read it now
    except OSError as exc:  # the files are here: this start serves them all the same
        log.warning("could not record %s as the cache's %s (%s): an offline start by that "
                    "name will not find it; name the commit instead", sha, revision, exc)


def hub_failure(ref: HubRef, exc: Exception, doing: str) -> HubError:
    """A failed call to the Hub as one line for the client, naming the model and what to
    do; the Hub's own answer (its address, its text) goes to the log only."""
    cause: BaseException | None = exc
    while cause is not None and getattr(cause, "response", None) is None:
        cause = cause.__cause__ or cause.__context__  # the client wraps the HTTP error
    status = getattr(getattr(cause, "response", None), "status_code", None)
    if status in (401, 403):  # reached, and refused: the repository is gated or private
        return NotOnHub(f"model {ref}: the Hub refused access to it ({status}); it may be "
                        "gated or private: set HF_TOKEN to a token allowed to read it")
    log.warning("%s: the Hub failed while %s: %s: %s", ref, doing, type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "")
    what = f"answered {status}" if status else f"could not be reached ({type(exc).__name__})"
    return HubError(f"model {ref}: the Hub {what} while {doing}; try again later, check "
                    "HF_ENDPOINT and the network, or set HF_HUB_OFFLINE=1 to use the cache")


def _inside(name: str) -> bool:
    """Whether a file name a repository lists stays inside its folder once downloaded."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(
        part not in ("", ".", "..") for part in parts)


def _match(name: str, pattern: str) -> bool:
    from fnmatch import fnmatch

    return fnmatch(name, pattern)


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


def progress_class(label: str) -> type:
    """A tqdm class for snapshot_download that draws nothing and logs the bytes received,
    at most once every PROGRESS_EVERY_S (a bar would break --log-format json)."""
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    state = {"last": time.monotonic(), "started": time.monotonic()}
    guard = threading.Lock()

    class LogProgress(hub_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            self._bytes = kwargs.get("unit") == "B"
            self._received = float(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

        def update(self, n: float | None = 1) -> bool | None:
            self._received += n or 0
            if not self._bytes:
                return None
            now = time.monotonic()
            with guard:
                if now - state["last"] < PROGRESS_EVERY_S:
                    return None
                state["last"] = now
            rate = self._received / max(now - state["started"], 1e-6)
            total = self.total or 0
            log.info("%s: %s of %s received (%s/s)", label, human_bytes(self._received),
                     human_bytes(total) if total else "?", human_bytes(rate))
            return None

    return LogProgress


def backbone(folder: Path) -> HubRef | None:
    """The Hub repository a GLiNER folder takes its backbone's config and tokenizer from,
    when it does not carry them itself (GLiNER v2 repositories ship their own weights and
    config only); None when it needs none."""
    config_file = folder / "gliner_config.json"
    if not config_file.is_file():
        return None
    try:
        config = read_model_json(config_file)
    except ModelFileError as exc:
        raise HubError(f"{folder}: {exc}") from None
    name = str(config.get("model_name", ""))
    self_contained = ((folder / "tokenizer_config.json").is_file()
                      and bool(config.get("encoder_config")))
    if self_contained:
        return None
    if Path(name).expanduser().is_dir():
        if cache_root().resolve() in folder.resolve().parents:  # a download names a path
            raise HubError(f"{folder.name}: gliner_config.json names a folder of this "
                           f"machine ({name!r}) as its backbone; a model from the Hub may "
                           "name only a Hub repository")
        return None  # the operator's own folder, beside theirs
    return parse_hub_id(name)


def backbone_folder(folder: Path, download: bool | None = None) -> Path | None:
    """The local folder of the repository `folder` takes its backbone's config and
    tokenizer from (`backbone`), fetched where `download` (default: this process's policy)
    allows; None when it needs none."""
    ref = backbone(folder)
    return None if ref is None else snapshot(ref, Wanted(weights=False), download=download)


def snapshot_bytes(folder: Path) -> int:
    """Bytes of a snapshot's files (the blobs its links point at)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
