"""ModelWorker: one per loaded model; its loop applies the dispatch rules R1-R10.

The policy reads top to bottom in `_run`; each step names its rule in DESIGN.md.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from ember.engine.batcher import BatchFormer, PendingItem
from ember.engine.config import WorkerConfig
from ember.engine.errors import QueueFull, ShuttingDown
from ember.engine.stats import BatchRecord, RequestRecord, WorkerStats
from ember.engine.types import Adapter, PreparedItem, RequestResult


@dataclass(eq=False)
class _Request:
    """A submitted request while it is in the worker."""

    future: asyncio.Future[RequestResult]
    size: int
    submitted_at: float
    results: list[Any] = field(default_factory=list)
    remaining: int = 0
    first_dispatch_at: float | None = None
    inference_s: float = 0.0
    forwards: int = 0

    @property
    def live(self) -> bool:
        return not self.future.done()


class ModelWorker:
    """Queues prepared items per LoRA and runs them through one adapter in batches."""

    def __init__(self, adapter: Adapter, config: WorkerConfig | None = None,
                 *, name: str = "model") -> None:
        self.adapter = adapter
        self.config = config or WorkerConfig()
        self.name = name
        self.stats = WorkerStats()
        self._batchers: dict[str | None, BatchFormer] = {}
        self._wake = asyncio.Event()  # R1: set by submit(), resume() and stop()
        self._arrival = asyncio.Event()  # set on every arrival, ends a window's wait early
        self._seq = itertools.count()
        self._pending_total = 0
        self._paused = False
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._active_lora: str | None = None
        # Per LoRA: when its last forward ended and how many requests it carried.
        self._last_forward: dict[str | None, tuple[float, int]] = {}

    # -- public API ---------------------------------------------------------------

    @property
    def pending_items(self) -> int:
        return self._pending_total

    @property
    def pending_requests(self) -> int:
        return sum(b.pending_requests for b in self._batchers.values())

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def start(self) -> None:
        if self._task is not None:
            return
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ember-forward-{self.name}")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"worker-{self.name}")

    async def stop(self) -> None:
        """R8: refuse new work, dispatch all that is pending at once, resolve every future."""
        self._stopping = True
        self._paused = False
        self._wake.set()
        self._arrival.set()
        if self._task is not None:
            await asyncio.shield(self._task)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def pause(self) -> None:
        """Hold dispatch: requests queue but no new batch is selected until resume()."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def submit(self, items: Sequence[PreparedItem], params: Hashable,
                     *, lora: str | None = None) -> asyncio.Future[RequestResult]:
        """Queue one request; its future resolves when all of its items have results."""
        if self._stopping:
            raise ShuttingDown()
        if self._task is None:
            raise RuntimeError(f"worker {self.name!r} is not started: await start() first")
        if not items:
            raise ValueError("a request needs at least one item")
        indices = {item.index for item in items}
        if len(indices) != len(items) or min(indices) != 0 or max(indices) != len(items) - 1:
            raise ValueError("item indices must be 0..n-1, one each")
        if self._pending_total + len(items) > self.config.max_queue_items:  # R7
            raise QueueFull(self._pending_total, len(items), self.config.max_queue_items)
        loop = asyncio.get_running_loop()
        now = self._now()
        request = _Request(loop.create_future(), len(items), now, [None] * len(items), len(items))
        batcher = self._batchers.get(lora)
        if batcher is None:
            cfg = self.config
            batcher = BatchFormer(cfg.max_batch_tokens, cfg.max_batch_items,
                                  cfg.starvation_ms / 1000)
            self._batchers[lora] = batcher
        batcher.add([PendingItem(item, request, params, now, next(self._seq)) for item in items])
        self._pending_total += len(items)
        self._wake.set()
        self._arrival.set()
        return request.future

    # -- the loop: the dispatch policy in one place ---------------------------------

    async def _run(self) -> None:
        idle = True
        try:
            while True:
                self._drop_dead()  # R9: cancelled requests never reach a forward
                if not self._has_work():
                    if self._stopping and self._pending_total == 0:
                        return
                    self._wake.clear()
                    await self._wake.wait()  # R1: sleep until submit/resume/stop
                    idle = True
                    continue
                lora, batcher = self._select()  # R2
                if not self._stopping:
                    if idle:
                        await self._idle_window(lora, batcher)  # R3
                    else:
                        await self._coalesce(batcher, self.config.coalesce_ms)  # R4, while busy
                    if self._paused:
                        continue
                await self._dispatch(lora, batcher.form(self._now()))  # R5, R6
                idle = False
                await self._drain(lora, batcher)  # R4: the backlog, without waiting
        finally:
            self._fail_leftovers()

    def _has_work(self) -> bool:
        return self._pending_total > 0 and (not self._paused or self._stopping)

    def _select(self) -> tuple[str | None, BatchFormer]:
        """R2: the batcher whose oldest pending item arrived first (FCFS across LoRAs)."""
        waiting = [(lora, b) for lora, b in self._batchers.items() if b.pending_items]
        return min(waiting, key=lambda entry: cast(float, entry[1].oldest_arrival))

    async def _idle_window(self, lora: str | None, batcher: BatchFormer) -> None:
        """R3: a lone request goes at once; a burst already queued coalesces."""
        cfg = self.config
        if cfg.idle_coalesce_ms == 0:
            return
        if batcher.pending_requests == 1 and not cfg.hold_lone_idle_requests:
            expected = self._returning_senders(lora)
            if expected > 1:  # R3d: the senders of a fused forward are on their way back
                await self._coalesce(batcher, cfg.idle_coalesce_ms, expected)
            return
        await self._coalesce(batcher, cfg.idle_coalesce_ms)

    def _returning_senders(self, lora: str | None) -> int:
        """How many requests the last forward on `lora` carried, if it ended within
        `returning_window_ms` (0 when the rule is off or the forward is not recent)."""
        cfg = self.config
        if not cfg.hold_for_returning_senders or lora not in self._last_forward:
            return 0
        ended, requests = self._last_forward[lora]
        return requests if self._now() - ended <= cfg.returning_window_ms / 1000 else 0

    async def _coalesce(self, batcher: BatchFormer, quiet_ms: float,
                        expected_requests: int | None = None,
                        since: float | None = None) -> None:
        """Take arrivals until none came for `quiet_ms`, the batch is full, the
        `expected_requests` are all there, or the oldest pending item has waited
        `max_batch_wait_ms`; with `since`, both clocks start no earlier than it."""
        max_wait = self.config.max_batch_wait_ms / 1000
        while not self._stopping and not self._paused:
            self._drop_dead(batcher)
            oldest, last = batcher.oldest_arrival, batcher.last_arrival
            if oldest is None or last is None or batcher.is_full(self._now()):
                return
            if since is not None:  # a hold after a forward: its own clock, not the backlog's
                last, oldest = max(last, since), max(oldest, since)
            if expected_requests is not None and batcher.pending_requests >= expected_requests:
                return
            timeout = min(last + quiet_ms / 1000, oldest + max_wait) - self._now()
            if timeout <= 0:
                return
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), timeout)
            except TimeoutError:
                return

    async def _drain(self, lora: str | None, batcher: BatchFormer) -> None:
        """R4: dispatch what accumulated during the forward, bounded by that backlog;
        later arrivals wait for the next selection so other batchers get a turn."""
        self._drop_dead(batcher)
        carried = self._last_forward.get(lora, (0.0, 0))[1]
        hold_ms = self.config.drain_hold_ms
        if hold_ms > 0 and carried >= 2 and batcher.pending_items and not self._stopping:
            # R4b (opt-in): the senders just answered are on their way back; let them
            # join the backlog instead of alternating with it in half-full forwards.
            await self._coalesce(batcher, hold_ms, batcher.pending_requests + carried,
                                 since=self._now())
        cutoff = batcher.newest_seq
        while not self._paused or self._stopping:
            batch = batcher.form(self._now(), upto_seq=cutoff)
            if not batch:
                return
            await self._dispatch(lora, batch)

    async def _dispatch(self, lora: str | None, batch: list[PendingItem]) -> None:
        """Run one forward in the worker thread and deliver its results (R9, R10)."""
        if not batch:
            return
        loop = asyncio.get_running_loop()
        started = self._now()
        self._pending_total -= len(batch)
        requests = list(dict.fromkeys(cast(_Request, p.owner) for p in batch))
        for request in requests:
            if request.first_dispatch_at is None:
                request.first_dispatch_at = started
        items = [p.item for p in batch]
        padded = len(items) * max(item.cost for item in items)
        assert self._executor is not None
        error: Exception | None = None
        values: Sequence[Any] = ()
        try:
            values = await loop.run_in_executor(self._executor, self._forward, lora, items,
                                                batch[0].group)
            if len(values) != len(items):
                raise RuntimeError(f"adapter returned {len(values)} results for "
                                   f"{len(items)} items")
        except Exception as exc:  # R9: the error belongs to this forward's requests only
            error = exc
        ended = self._now()
        elapsed = ended - started
        self._last_forward[lora] = (ended, len(requests))
        self.stats.record_batch(BatchRecord(len(items), len(requests), padded, lora,
                                            elapsed * 1000, error is not None))
        if error is None:
            for pending, value in zip(batch, values, strict=True):
                owner = cast(_Request, pending.owner)
                owner.results[pending.item.index] = value
                owner.remaining -= 1
        for request in requests:
            request.inference_s += elapsed
            request.forwards += 1
            if error is not None:
                self._finish(request, error)
            elif request.remaining == 0:
                self._finish(request, None)

    def _forward(self, lora: str | None, items: list[PreparedItem],
                 params: Hashable) -> Sequence[Any]:
        """Runs in the worker thread: switch LoRA if needed, then one forward."""
        if lora != self._active_lora:
            self.adapter.set_lora(lora)
            self._active_lora = lora
        return self.adapter.forward(items, params)

    def _finish(self, request: _Request, error: BaseException | None) -> None:
        dispatched = request.first_dispatch_at or self._now()
        queue_ms = (dispatched - request.submitted_at) * 1000
        inference_ms = request.inference_s * 1000
        if not request.future.done():
            if error is None:
                request.future.set_result(RequestResult(request.results, queue_ms,
                                                        inference_ms, request.forwards))
            else:
                request.future.set_exception(error)
        self.stats.record_request(RequestRecord(request.size, queue_ms, inference_ms,
                                                error is not None))

    def _drop_dead(self, only: BatchFormer | None = None) -> None:
        for batcher in [only] if only else self._batchers.values():
            dropped = batcher.drop_dead()
            if dropped:
                self._pending_total -= dropped
                self.stats.record_dropped(dropped)

    def _fail_leftovers(self) -> None:
        """Should the loop ever end with work queued, no accepted future is left hanging."""
        error = ShuttingDown() if self._stopping else RuntimeError(
            f"worker {self.name!r} loop ended unexpectedly")
        for batcher in self._batchers.values():
            while batch := batcher.form(self._now()):
                for request in dict.fromkeys(cast(_Request, p.owner) for p in batch):
                    self._finish(request, error)

    @staticmethod
    def _now() -> float:
        # Not loop.time(): uvloop's clock ticks in whole milliseconds, too coarse for
        # windows of 2-3 ms and for the queue times the API reports.
        return time.perf_counter()
