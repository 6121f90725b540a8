"""The contract between model families and the layers above them.

A model adapter is the engine's `Adapter` (one forward over prepared items,
`set_lora`) plus the task methods the API calls. A task method tokenizes on
the request path, so every prepared item carries its true cost, then hands
items to `submit` (the model's worker) and shapes the results.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    Protocol,
    TypedDict,
    TypeVar,
    runtime_checkable,
)

import numpy as np
import numpy.typing as npt

from ember.config import (
    ADAPTERS,
    PROMPT_NAMES,
    Backend,
    ModelSpec,
    Spinning,
    resolve_source,
)
from ember.engine.types import PreparedItem, RequestResult
from ember.errors import InvalidInput

if TYPE_CHECKING:
    from ember.config import ServerSettings

Task = Literal["encode", "score", "extract"]
Submit = Callable[[Sequence[PreparedItem], Hashable, "str | None"], Awaitable[RequestResult]]
T = TypeVar("T")


@dataclass(frozen=True)
class EncodeOptions:
    is_query: bool = False
    instruction: str | None = None
    truncate: bool = True
    normalize: bool | None = None  # None: the model's configured default
    lora: str | None = None
    output_types: tuple[str, ...] = ()  # none: the model's own output


@dataclass(frozen=True)
class ScoreOptions:
    truncate: bool = True
    lora: str | None = None
    raw: bool = False  # a cross-encoder's logits, before its activation (TEI's raw_scores)
    # Each output's weight in this request's score, where a family scores by several (m3);
    # a dict, so left out of the hash.
    score_weights: dict[str, float] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class ExtractOptions:
    labels: tuple[str, ...] | None = None  # friendly or native names; None: all
    threshold: float | None = None  # zero-shot families: least score kept; None: the model's


@dataclass(frozen=True)
class SparseVector:
    """Non-zero weights over a vocabulary of `dims`; indices sorted and unique."""

    indices: npt.NDArray[np.int32]
    values: npt.NDArray[np.float32]
    dims: int


@dataclass
class Encoded:
    """The outputs of one encoded item, by output type."""

    dense: npt.NDArray[np.float32] | None = None
    sparse: SparseVector | None = None
    multivector: npt.NDArray[np.float32] | None = None  # (num_tokens, token_dims)


@dataclass(frozen=True)
class Entity:
    text: str
    label: str
    start: int
    end: int
    score: float


class TokenSpan(TypedDict):
    """One token of a text as the model reads it (TEI's /tokenize): its id and text and,
    for a token of the text (not a special one), where it lies, in UTF-8 bytes as TEI
    counts them. A dict, as it is answered: a text may have 200,000 tokens."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


@dataclass
class TaskOutput(Generic[T]):
    """A task's values with the accounting the API reports (R10)."""

    values: T
    queue_ms: float
    inference_ms: float
    tokens: int  # input tokens after truncation, for usage counts


# What models call the document side's prompt, in sentence-transformers' order.
DOCUMENT_PROMPTS = PROMPT_NAMES[1:]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    tasks: tuple[Task, ...]
    dims: int | None = None
    max_seq_length: int | None = None
    loras: tuple[str, ...] = ()
    output_types: tuple[str, ...] = ("dense",)
    labels: tuple[str, ...] = ()
    extra: dict[str, object] = field(default_factory=dict)
    # Each output's size where they differ (an M3 model's); empty: every output is `dims`.
    output_dims: dict[str, int] = field(default_factory=dict)


def combine(results: Sequence[RequestResult]) -> tuple[float, float]:
    """Queue and inference time of a task made of several submits made together: queued
    until its first forward began, in inference until its last one ended (the largest of
    each, taken apart, counted a forward twice where one submit waited on another's)."""
    if not results:
        return 0.0, 0.0
    queued = min(r.queue_ms for r in results)
    return queued, max(r.queue_ms + r.inference_ms for r in results) - queued


class TaskModel(Protocol):
    """The request-path half of a model, what the API calls: it tokenizes, submits prepared
    items and shapes the results. Tasks it lacks raise UnsupportedTask. An API process
    of several loads only this half (`load_front`); the engine process runs the forward."""

    info: ModelInfo

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]: ...

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]: ...

    async def extract(self, submit: Submit, texts: Sequence[str],
                      options: ExtractOptions) -> TaskOutput[list[list[Entity]]]: ...


@runtime_checkable
class ShowsTokens(Protocol):
    """A model whose tokenizer a route may show: its tokens for a text, and the text of
    token ids (TEI's /tokenize and /decode)."""

    async def token_spans(self, texts: Sequence[str], special: bool,
                          options: EncodeOptions) -> list[list[TokenSpan]]: ...

    async def decode_ids(self, rows: Sequence[Sequence[int]],
                         skip_special: bool) -> list[str]: ...


class ModelAdapter(TaskModel, Protocol):
    """A whole model, what the registry loads: the request path and the forward half.
    `fills_host_cores`: its forwards keep every core of the host busy, so request work
    that runs beside them slows them (the dispatch policy holds longer for returning
    senders there; see `forward_fills_cores`)."""

    @property
    def fills_host_cores(self) -> bool: ...

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> Sequence[object]: ...

    def set_lora(self, name: str | None) -> None: ...

    def memory_bytes(self) -> int:
        """Approximate resident size, for the registry's memory budget."""
        ...

    def close(self) -> None:
        """Release weights; called after the model's worker drained."""
        ...


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, as containers set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """torch's intra-op threads: all cores but one, which stays free for the front end
    (HTTP, tokenizing) and for neighbours; see README, Backends and threads."""
    return max(1, usable_cores() - 1)


def forward_fills_cores(runtime: Runtime, backend: str) -> bool:
    """Whether a forward on `backend` under `runtime` keeps every usable core busy: a CPU
    device with as many intra-op threads as cores (ONNX Runtime's default; torch's
    default leaves one core to the front end)."""
    if not runtime.device.startswith("cpu"):
        return False
    threads = ((runtime.onnx_threads or default_onnx_threads()) if backend == "onnx"
               else (runtime.torch_threads or default_threads()))
    return threads >= usable_cores()


def default_onnx_threads() -> int:
    """ONNX Runtime's intra-op threads: every core. Its forward runs without the GIL and
    its threads sleep between forwards, so the front end has the cores whenever no
    forward runs; measured faster than all cores but one once the front end got cheap
    (docs/bench/notes.md, Backends)."""
    return usable_cores()


def single_threaded_blas() -> None:
    """numpy's BLAS (OpenBLAS) on one thread in this process, from now on. Ember's numpy
    work is small (pooling, similarity, a ColBERT projection) and OpenBLAS's threads spin
    after each call on the cores the next forward needs: one MaxSim between one-text
    forwards made ONNX Runtime's next forward up to 3x as long on 2 cores
    (docs/bench/notes.md, "numpy around the forward")."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


# One model load at a time in a process: transformers resolves its classes lazily on first
# use, and two threads doing that at once get "cannot import name" for one of them.
_LOAD_LOCK = threading.Lock()
LoadT = TypeVar("LoadT")


def one_load_at_a_time(load: Callable[[ModelSpec, Runtime], LoadT]
                       ) -> Callable[[ModelSpec, Runtime], LoadT]:
    """`load` (a family's load or load_front) made to wait for any other load running in
    this process; the event loop keeps serving while a load waits in its thread. A Hub
    model's files are fetched first, outside the lock: a download of minutes must not hold
    up the loads of models already on disk."""
    @functools.wraps(load)
    def serialized(spec: ModelSpec, runtime: Runtime) -> LoadT:
        if spec.source.hub is not None:
            resolve_source(spec)  # downloads when this process may; cached, it only looks
        with _LOAD_LOCK:
            return load(spec, runtime)
    return serialized


def check_lora(name: str | None, known: Sequence[str],
               param: str = "params.options.lora") -> None:
    """Refuse a request naming a LoRA this model does not have."""
    if name is None or name in known:
        return
    names = ", ".join(known) if known else "none (this model has no LoRA adapters)"
    raise InvalidInput(f"unknown LoRA {name!r}; known LoRAs: {names}", param)


def import_family(family: str) -> ModuleType:
    """A family's module, imported now if not yet: torch or spaCy only come into a process
    that loads a model of a family needing them (seconds: a server imports it in a thread,
    off its event loop)."""
    return importlib.import_module(f"ember.adapters.{ADAPTERS[family]}")


def family_loader(family: str, function: str) -> Callable[[ModelSpec, Runtime], Any]:
    """A family module's `function` (`load`, or `load_front` for an API process), one load
    at a time; the module is imported now if not yet (`import_family`)."""
    module = import_family(family)
    single_threaded_blas()  # a process that serves models leaves the cores to them
    return one_load_at_a_time(getattr(module, function))


@dataclass(frozen=True)
class Runtime:
    """Where and how a model runs: CPU here; CUDA with fp16 when present. `backend` is
    the server-wide preference; a model's YAML may name its own (see _backend)."""

    device: str = "cpu"
    torch_threads: int | None = None  # None: default_threads()
    backend: Backend = "onnx"
    cache_dir: Path | None = None  # None: $EMBER_CACHE_DIR, else the user cache (_onnx)
    onnx_threads: int | None = None  # None: default_onnx_threads()
    onnx_spinning: Spinning = "forward"

    @property
    def half(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> Runtime:
        return cls(settings.device, settings.torch_threads, settings.backend,
                   settings.cache_dir, settings.onnx_threads, settings.onnx_spinning)
