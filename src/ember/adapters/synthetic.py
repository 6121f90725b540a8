"""The synthetic adapter: a TEST AND BENCHMARK model, never a real one.

It returns deterministic unit vectors derived from each text (and the active
LoRA), and takes a forward time from a cost model,
`overhead_ms + per_token_us * padded tokens` (padded tokens = items x longest),
either sleeping (a GPU-like device that leaves the CPU free) or computing (a
CPU-like device that keeps a core busy); `load_ms` is how long its weights take to
load (the engine's load sleeps that long; a front half has no weights). A text
containing `fault_marker` makes its whole forward raise, for fault-injection tests.
TESTS ONLY: a model whose options set `test_crash_marker` ends the process that runs a
forward holding a text that contains it (`os._exit`, as a native crash in a model
would), so that the tests can send a request that kills the engine; no catalog entry
sets it, and without it no input does this.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from ember.adapters.base import (
    Encoded,
    EncodeOptions,
    Entity,
    ExtractOptions,
    ModelInfo,
    Runtime,
    ScoreOptions,
    Submit,
    Task,
    TaskOutput,
)
from ember.config import ModelSpec
from ember.engine.types import PreparedItem
from ember.errors import InvalidInput, UnsupportedTask

CostMode = Literal["sleep", "compute"]


@dataclass(frozen=True)
class CostModel:
    """Forward time of the synthetic device."""

    overhead_ms: float = 2.0
    per_token_us: float = 0.5
    mode: CostMode = "sleep"

    def forward_seconds(self, items: int, longest: int) -> float:
        return (self.overhead_ms * 1e3 + self.per_token_us * items * longest) / 1e6


CRASH_EXIT_CODE = 86  # the exit code of a process a forward with the crash marker ended


class SyntheticFault(RuntimeError):
    """Raised by a forward that carries the fault marker."""


class SyntheticAdapter:
    """Deterministic vectors and a modelled forward time. For tests and benchmarks only."""

    def __init__(self, dims: int = 32, cost: CostModel | None = None,
                 fault_marker: str = "__fail__", test_crash_marker: str | None = None) -> None:
        self.dims = dims
        self.cost = cost or CostModel()
        self.fault_marker = fault_marker
        self.test_crash_marker = test_crash_marker  # TESTS ONLY: ends the process; off if None
        self._lora: str | None = None
        self._spin_a = np.ones((64, 64), dtype=np.float32)

    @staticmethod
    def prepare(texts: Sequence[str]) -> list[PreparedItem]:
        """Items whose cost is the word count (at least 1), standing in for tokens."""
        return [PreparedItem(text, max(1, len(text.split())), i) for i, text in enumerate(texts)]

    fills_host_cores = False  # a forward sleeps, or keeps one core busy

    def set_lora(self, name: str | None) -> None:
        self._lora = name

    def forward(self, items: Sequence[PreparedItem],
                params: Hashable) -> list[npt.NDArray[np.float32]]:
        texts = tuple(str(item.payload) for item in items)
        crash = self.test_crash_marker
        if crash and any(crash in text for text in texts):
            os._exit(CRASH_EXIT_CODE)  # no cleanup, no answer: as a segfault in native code
        self._spend(self.cost.forward_seconds(len(items), max(item.cost for item in items)))
        if any(self.fault_marker in text for text in texts):
            raise SyntheticFault(f"synthetic fault injected by an input containing "
                                 f"{self.fault_marker!r}")
        return [self.vector(text, self._lora) for text in texts]

    def vector(self, text: str, lora: str | None = None) -> npt.NDArray[np.float32]:
        """The unit vector this adapter returns for `text` under `lora`: the text's hash,
        read as int16s and scaled to length 1. A few microseconds an item, as a GPU's copy
        out would be (a seeded generator cost ~20, CPU a GPU-like model should not spend)."""
        raw = hashlib.shake_128(f"{lora}\x00{text}".encode()).digest(2 * self.dims)
        vec = np.frombuffer(raw, dtype="<i2").astype(np.float32)
        vec /= np.float32(math.sqrt(float(vec @ vec)) or 1.0)
        return vec

    def _spend(self, seconds: float) -> None:
        if self.cost.mode == "sleep":
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            self._spin_a @ self._spin_a  # real arithmetic keeps a core busy, like a CPU forward


class SyntheticModel(SyntheticAdapter):
    """The synthetic adapter served like a catalog model (encode and score).

    FOR TESTS AND BENCHMARKS ONLY: its vectors carry no meaning.
    """

    def __init__(self, info: ModelInfo, dims: int, cost: CostModel, fault_marker: str,
                 test_crash_marker: str | None = None) -> None:
        super().__init__(dims, cost, fault_marker, test_crash_marker)
        self.info = info

    async def encode(self, submit: Submit, texts: Sequence[str],
                     options: EncodeOptions) -> TaskOutput[list[Encoded]]:
        if options.lora is not None:
            raise InvalidInput(f"LoRA {options.lora!r} is unknown; this model has none",
                               "params.options.lora")
        items = self.prepare(texts)
        result = await submit(items, ("encode", options.is_query), None)
        return TaskOutput([Encoded(dense=v) for v in result.values], result.queue_ms,
                          result.inference_ms, sum(i.cost for i in items))

    async def score(self, submit: Submit, query: str, docs: Sequence[str],
                    options: ScoreOptions) -> TaskOutput[list[float]]:
        items = self.prepare([query, *docs])
        result = await submit(items, ("encode", False), None)
        query_vec, *doc_vecs = result.values
        scores = [float(np.dot(query_vec, d)) for d in doc_vecs]
        return TaskOutput(scores, result.queue_ms, result.inference_ms,
                          sum(i.cost for i in items))

    async def extract(self, submit: Submit, texts: Sequence[str],
                      options: ExtractOptions) -> TaskOutput[list[list[Entity]]]:
        raise UnsupportedTask(self.info.name, "extract", self.info.tasks)

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to release."""


def load(spec: ModelSpec, runtime: Runtime) -> SyntheticModel:
    time.sleep(float(spec.options.get("load_ms", 0)) / 1e3)  # a big model's weights
    return _model(spec)


def _model(spec: ModelSpec) -> SyntheticModel:
    options = spec.options
    dims = int(options.get("dims", 64))
    cost = CostModel(float(options.get("overhead_ms", 2.0)),
                     float(options.get("per_token_us", 0.5)),
                     "compute" if options.get("mode") == "compute" else "sleep")
    tasks: tuple[Task, ...] = tuple(t for t in ("encode", "score") if t in spec.tasks)
    info = ModelInfo(name=spec.name, tasks=tasks, dims=dims, max_seq_length=spec.max_seq_length,
                     extra={"normalize": True})  # its vectors are unit
    crash = options.get("test_crash_marker")  # TESTS ONLY: see the module's docstring
    return SyntheticModel(info, dims, cost, str(options.get("fault_marker", "__fail__")),
                          str(crash) if crash else None)


def load_front(spec: ModelSpec, runtime: Runtime) -> SyntheticModel:
    """The request path: the synthetic model has no weights, so its front half is the
    whole model (in an API process its forwards still run in the engine process)."""
    return _model(spec)
