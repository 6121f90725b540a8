"""ModelWorker: one per loaded model; per-LoRA queues, the dispatch loop, the forward thread.

The loop (on the event loop) keeps the next batch formed in a slot while the
current forward runs (prefetch) and releases it when the policy says; the forward
thread takes a released batch the moment its forward ends, so the device never
waits for Python. Results come back to the loop, which resolves the futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from operator import attrgetter
from typing import Any, cast

from ember.engine.batcher import Batch, BatchFormer, PendingItem
from ember.engine.config import WorkerConfig
from ember.engine.errors import QueueFull, RequestTooLarge, ShuttingDown, WorkerFailed
from ember.engine.policy import DispatchPolicy, LastForward, QueueView
from ember.engine.stats import BatchRecord, RequestRecord, WorkerStats
from ember.engine.types import Adapter, PreparedItem, RequestResult

log = logging.getLogger("ember.engine")
_OWNER = attrgetter("owner")
_ITEM = attrgetter("item")
_ARRIVAL = attrgetter("arrival")
_INDEX = attrgetter("index")
RECENT = 64  # arrival times kept per lane: enough to count those near a forward's end


@dataclass(eq=False, slots=True)
class _Request:
    """A submitted request while it is in the worker."""

    future: asyncio.Future[RequestResult]
    lora: str | None
    submitted_at: float
    results: list[Any]
    remaining: int
    items: list[PendingItem] = field(default_factory=list)
    first_dispatch_at: float | None = None
    inference_s: float = 0.0
    forwards: int = 0
    recorded: bool = False
    on_done: Callable[[asyncio.Future[RequestResult]], None] | None = None

    def release(self) -> None:
        """Once resolved: let go of its items and callback, which point back at it, so
        refcounting frees it at once instead of leaving a cycle to the collector."""
        self.items = []
        self.on_done = None


@dataclass(eq=False)
class _Forward:
    """A released batch on its way through the forward thread."""

    batch: Batch
    # R10: the batch left the queue when it was released and the device was free; the
    # forward thread's wake-up after that is the engine's hand-off, counted as inference.
    dispatched: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    values: Sequence[Any] = ()
    error: BaseException | None = None
    _owners: Counter[Any] | None = None

    def owners(self) -> Counter[Any]:
        """The batch's requests, each once, in batch order, with their items in it
        (worked out once, counted in C)."""
        if self._owners is None:
            self._owners = Counter(map(_OWNER, self.batch.items))
        return self._owners

    @property
    def requests(self) -> int:
        return len(self.owners())


@dataclass
class _Lane:
    """Per-LoRA state: its queue and what the policy needs to know about it."""

    former: BatchFormer
    arrived: int = 0  # requests submitted so far
    arrived_at_last_end: int = 0
    last_arrival: float = 0.0
    last_forward: LastForward | None = None
    # Whether senders come back: after each forward of several requests, did enough of
    # them (policy.returns_needed) return within the hold's own bound? Closed-loop clients
    # on a busy device do; open-loop arrivals, one-off bursts and clients slowed by a front
    # end that limits do not (a hold would only idle the device while they trickle in). A
    # forward of one request leaves the answer as it was.
    senders_return: bool = False
    probe_target: int = 0  # `arrived` that means enough of them are back
    probe_end: float = -1.0  # < 0: no probe running
    recent_arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def senders_may_return(self, now: float) -> bool:
        """Seen to come back, or a probe still running: the policy's `senders_return`."""
        return self.senders_return or now <= self.probe_end

    def arrivals_between(self, begin: float, end: float) -> int:
        """Requests that arrived in [begin, end), of the last RECENT (at most RECENT)."""
        count = 0
        for arrival in reversed(self.recent_arrivals):
            if arrival < begin:
                break
            count += arrival < end
        return count


class ModelWorker:
    """Queues prepared items per LoRA and runs them through one adapter in batches."""

    def __init__(self, adapter: Adapter, config: WorkerConfig | None = None,
                 *, name: str = "model", policy: DispatchPolicy | None = None,
                 former: Callable[[WorkerConfig], BatchFormer] | None = None) -> None:
        self.adapter = adapter
        self.config = config or WorkerConfig()
        self.policy = policy or DispatchPolicy(self.config)
        self._new_former = former or BatchFormer.for_config  # a lane's queue (R5)
        self.name = name
        self.stats = WorkerStats()
        self._lanes: dict[str | None, _Lane] = {}
        self._requests: set[_Request] = set()  # accepted and not yet resolved
        self._seq = itertools.count()
        self._queued = 0  # items in the lanes' formers
        self._wake = asyncio.Event()  # R1: set by submit, a forward's end, stop
        # Guards the slot and the forward in flight. A plain Lock: `with self._lock` runs
        # in C, where `with` on a Condition is a Python call each way.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._slot: Batch | None = None  # the next batch, formed ahead (prefetch)
        self._released = False  # the slot may go as soon as the thread is free
        # A batch released while the thread waited: the thread's already, so the loop forms
        # the next one at once instead of sleeping until the thread wakes and takes it.
        self._handed: Batch | None = None
        self._in_flight: _Forward | None = None
        self._finished: deque[_Forward] = deque()  # appended by the thread, read by the loop
        self._thread_exit = False
        self._thread: threading.Thread | None = None
        self._active_lora: str | None = None
        self._stopping = False
        self._failure: WorkerFailed | None = None
        self._task: asyncio.Task[None] | None = None
        self._restart_lock = asyncio.Lock()

    # -- public API ---------------------------------------------------------------

    @property
    def pending_items(self) -> int:
        """Items accepted and not yet in a forward (the next batches included)."""
        slot, handed = self._slot, self._handed
        return (self._queued + (len(slot.items) if slot is not None else 0)
                + (len(handed.items) if handed is not None else 0))

    @property
    def running_items(self) -> int:
        """Items in the forward on the device now (0 while it idles)."""
        forward = self._in_flight
        return len(forward.batch.items) if forward is not None else 0

    @property
    def pending_requests(self) -> int:
        return sum(self._lane_requests(lora) for lora in self._lanes)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def failure(self) -> WorkerFailed | None:
        """The error the loop failed with (then call restart()), or None."""
        return self._failure

    async def start(self) -> None:
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self.stats.defer = loop.call_soon  # metrics are written once the answers are out
        self._thread_exit = False
        self._thread = threading.Thread(target=self._forward_thread, args=(loop,),
                                        name=f"ember-forward-{self.name}", daemon=True)
        self._thread.start()
        self._task = loop.create_task(self._run(), name=f"ember-worker-{self.name}")

    async def stop(self) -> None:
        """R8: refuse new work, dispatch all that is pending at once, resolve every future."""
        self._stopping = True
        self._wake.set()
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait({task})  # never raises the loop's failure: _fail handled it
        await self._join_thread()

    async def restart(self) -> None:
        """Start a fresh loop and forward thread after a failure (or a stop); the
        stats and their listeners are kept."""
        async with self._restart_lock:
            if self.running and self._failure is None and not self._stopping:
                return
            await self.stop()
            self._lanes.clear()
            self._requests.clear()
            self._queued = 0
            self._slot, self._released, self._in_flight = None, False, None
            self._handed = None
            self._finished.clear()
            self._failure, self._stopping = None, False
            self._task = None
            await self.start()

    async def submit(self, items: Sequence[PreparedItem], params: Hashable,
                     *, lora: str | None = None) -> asyncio.Future[RequestResult]:
        """Queue one request. Its future resolves when all of its items have results;
        cancelling it drops the items not yet dispatched (R9)."""
        return self.submit_nowait(items, params, lora=lora)

    def submit_nowait(self, items: Sequence[PreparedItem], params: Hashable,
                      *, lora: str | None = None) -> asyncio.Future[RequestResult]:
        """`submit` from a plain function (on the event loop): the engine process queues a
        message's requests this way, with no Task for each."""
        if self._failure is not None:
            raise self._failure
        if self._stopping:
            raise ShuttingDown()
        if self._task is None:
            raise RuntimeError(f"worker {self.name!r} is not started: await start() first")
        if not items:
            raise ValueError("a request needs at least one item")
        count = len(items)
        if count == 1:
            if items[0].index != 0:
                raise ValueError("item indices must be 0..n-1, one each")
        elif (indices := list(map(_INDEX, items))) != list(range(count)) and (
                sorted(indices) != list(range(count))):
            raise ValueError("item indices must be 0..n-1, one each")
        limit = self.config.max_queue_items
        if count > limit:  # R7: it could never fit
            raise RequestTooLarge(count, limit)
        pending = self.pending_items
        if pending + count > limit:  # R7
            raise QueueFull(pending, count, limit)
        now = self._now()
        request = _Request(asyncio.get_running_loop().create_future(), lora, now,
                           [None] * count, count)
        seq = next(self._seq)  # a request's items arrive together: one place in line
        request.items = [PendingItem(item, request, params, now, seq) for item in items]
        lane = self._lanes.get(lora) or self._lane(lora)
        lane.arrived += 1
        lane.last_arrival = now
        lane.recent_arrivals.append(now)
        if log.isEnabledFor(logging.DEBUG):  # the dispatch trace: arrivals and forwards
            log.debug("%s: submit at=%.6f items=%d lora=%s", self.name, now, len(items), lora)
        if lane.probe_end >= now and lane.arrived >= lane.probe_target:
            lane.senders_return, lane.probe_end = True, -1.0
        self._requests.add(request)
        request.on_done = partial(self._on_resolved, request)
        request.future.add_done_callback(request.on_done)
        if self._queued == 0 and self._idle() and self._dispatch_alone(request, params, lane):
            return request.future  # the thread has it, and will wake the loop itself
        queued = self._revise_slot(lora, request.items)
        lane.former.add_request(queued)
        self._queued += len(queued)
        self._wake.set()
        return request.future

    # -- the loop: the dispatch policy in one place ---------------------------------

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                while self._finished:
                    self._deliver(self._finished.popleft())  # R9, R10
                if self._stopping and self._drained():
                    return
                if self._slot is None:
                    self._fill_slot()  # R2, R5, R6: formed while the forward runs
                formed = self._slot is not None
                deadline = self._review_slot()  # R3, R4
                if formed and self._slot is None and self._queued:
                    # Handed to the waiting thread: the next batch forms now, as it would
                    # once the thread had taken it (once a turn: the loop yields between).
                    self._fill_slot()
                    deadline = self._review_slot()
                if deadline is None:
                    await self._wake.wait()  # R1: until submit, a forward's end, stop
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), deadline - self._now())
        except BaseException as exc:
            self._fail(exc)
            if not isinstance(exc, Exception):
                raise  # a cancellation (or an interpreter exit) goes on up
        finally:
            with self._lock:
                self._thread_exit = True
                self._cond.notify_all()

    def _fill_slot(self) -> None:
        """R2: every batch comes from the lane whose oldest item arrived first, so an
        older request on another LoRA waits for at most one forward (FCFS across LoRAs)."""
        heads = [(head.seq, lora) for lora, lane in self._lanes.items()
                 if (head := lane.former.oldest()) is not None]
        if not heads:
            return
        lora = min(heads, key=lambda entry: entry[0])[1]
        batch = self._lanes[lora].former.form(lora)
        if batch is None:
            return
        self._queued -= len(batch.items)
        with self._lock:
            self._slot, self._released = batch, False

    def _review_slot(self) -> float | None:
        """Release the slot when the policy says; else return when to look again."""
        with self._lock:
            slot = self._slot
            if slot is None or self._released:
                return None
            running = self._in_flight
            handed = self._handed
            running_requests = (running.requests if running is not None
                                and running.batch.lora == slot.lora else None)
            if handed is not None and handed.lora == slot.lora:  # it runs next: as running
                running_requests = len(dict.fromkeys(map(_OWNER, handed.items)))
        now = self._now()
        at: float | None = now
        if not self._stopping:
            at = self.policy.release_at(self._view(slot), self._lanes[slot.lora].last_forward,
                                        running_requests, now)
        if at is not None and at <= now:
            with self._lock:
                if self._slot is slot:
                    slot.released_at = now
                    if self._in_flight is None and self._handed is None:
                        self._handed, self._slot = slot, None  # the thread waits for it
                    else:
                        self._released = True
                    self._cond.notify_all()
            return None
        return at

    def _dispatch_alone(self, request: _Request, params: Hashable, lane: _Lane) -> bool:
        """R1, R3b: a request that finds the worker idle and empty is the whole next batch,
        released from submit without a turn of the loop, if it fits one forward and the
        policy lets it go now (a hold for the last forward's senders may not)."""
        now = request.submitted_at
        view = QueueView(pending_requests=1, full=False, oldest_arrival=now, last_arrival=now,
                         arrived_since_forward=lane.arrived - lane.arrived_at_last_end,
                         senders_return=lane.senders_may_return(now), lora=request.lora)
        at = self.policy.release_at(view, lane.last_forward, None, now)
        if at is None or at > now:
            return False
        # Outside the sweep, as a led batch is: an arrival that would lead it does not put
        # it back (it would lead again, and the sweep's cursor would restart at 0).
        batch = Batch(request.lora, params, led=True)
        limits = lane.former.limits
        for pending in request.items:
            if not batch.fits(pending.item.cost, limits):
                for taken in batch.items:
                    taken.queued = True
                return False
            batch.add(pending)
        batch.released_at = self._now()  # after the policy and the batch: both are queue work
        with self._lock:
            self._handed = batch  # the worker is idle: the thread waits for it
            self._cond.notify_all()
        return True

    def _view(self, slot: Batch) -> QueueView:
        lane = self._lanes[slot.lora]
        head = lane.former.oldest()
        oldest = min(map(_ARRIVAL, slot.items))
        return QueueView(
            pending_requests=self._lane_requests(slot.lora),
            full=slot.full,
            oldest_arrival=min(oldest, head.arrival) if head is not None else oldest,
            last_arrival=lane.last_arrival,
            arrived_since_forward=lane.arrived - lane.arrived_at_last_end,
            senders_return=lane.senders_may_return(self._now()),
            lora=slot.lora,
        )

    def _revise_slot(self, lora: str | None, items: list[PendingItem]) -> list[PendingItem]:
        """Add arrivals to the next batches (the one handed to the thread first, while the
        thread has not taken it) while they fit; return those that stay queued."""
        if self._slot is None and self._handed is None:  # only the loop fills them (here)
            return items
        limits = self._lanes[lora].former.limits
        with self._lock:
            for batch in (self._handed, self._slot):
                if batch is None or batch.lora != lora or batch.group != items[0].group:
                    continue
                taken = 0
                for pending in items:
                    if not batch.fits(pending.item.cost, limits):
                        batch.full = True
                        break
                    batch.add(pending)
                    taken += 1
                if len(batch.items) >= limits.max_items:
                    batch.full = True
                items = items[taken:]
                if not items:
                    break
            if items:
                self._put_back_if_led(lora, items)
        return items

    def _put_back_if_led(self, lora: str | None, items: list[PendingItem]) -> None:
        """R5 as of the hand-off, not of the prefetch: when an arrival that did not fit the
        batches formed ahead would have led them (`BatchFormer.would_lead`), they go back
        to the queue and the loop forms again, so the arrival leads the next forward
        instead of waiting through the one formed before it came. Called under the lock."""
        formed = [batch for batch in (self._handed, self._slot) if batch is not None]
        if not formed or any(batch.lora != lora for batch in formed):
            return
        former = self._lanes[lora].former
        if not former.would_lead(formed[0], items):
            return
        for batch in reversed(formed):  # the later first: the earlier's items lead again
            former.put_back(batch)
            self._queued += len(batch.items)
        self._handed, self._slot, self._released = None, None, False

    # -- the forward thread ----------------------------------------------------------

    def _forward_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take each released batch as soon as the previous forward ends; run it."""
        device_free = 0.0
        while True:
            with self._lock:
                while not (self._handed is not None or self._released or self._thread_exit):
                    self._cond.wait()
                tell = self._handed is None  # a handed batch: the loop forms on already
                if self._handed is not None:
                    batch, self._handed = self._handed, None
                elif self._released:
                    batch = cast(Batch, self._slot)
                    self._slot, self._released = None, False
                else:
                    return
                started = self._now()
                forward = _Forward(batch, min(started, max(batch.released_at, device_free)),
                                   started)
                self._in_flight = forward
            if tell:
                self._tell_loop(loop)  # so it forms the next batch while this one runs
            try:
                if batch.lora != self._active_lora:
                    self.adapter.set_lora(batch.lora)
                    self._active_lora = batch.lora
                forward.values = self.adapter.forward(list(map(_ITEM, batch.items)),
                                                      batch.group)
                if len(forward.values) != len(batch.items):
                    raise RuntimeError(f"adapter returned {len(forward.values)} results "
                                       f"for {len(batch.items)} items")
            except BaseException as exc:  # R9: the error belongs to this forward's requests
                forward.error = exc
            forward.ended = device_free = self._now()
            with self._lock:
                self._in_flight = None
                self._finished.append(forward)
            # Not kept while this thread waits: through its requests, the whole answer.
            del forward, batch
            if not self._tell_loop(loop):
                return

    def _tell_loop(self, loop: asyncio.AbstractEventLoop) -> bool:
        try:
            loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the event loop is gone: nobody is left to tell
            return False
        return True

    # -- results and accounting --------------------------------------------------------

    def _deliver(self, forward: _Forward) -> None:
        """R9, R10: results into their requests; a failed forward fails exactly its
        requests; a request cancelled meanwhile is recorded as cancelled."""
        batch = forward.batch
        lane = self._lanes[batch.lora]
        elapsed = forward.ended - forward.started
        owners: Counter[_Request] = forward.owners()
        requests: list[_Request] = list(owners)
        if 0 <= lane.probe_end < self._now():  # the last probe ran out: they did not
            lane.senders_return, lane.probe_end = False, -1.0
        hold = self.policy.hold_s(len(requests), elapsed, batch.lora)  # 0 for one request
        watch = self.policy.watches_senders(
            len(requests), hold,
            lambda tail: lane.arrivals_between(forward.ended - tail, forward.ended),
            batch.lora)
        if not watch and len(requests) >= 2:  # others arrived as it ran: not its senders
            lane.senders_return, lane.probe_end = False, -1.0
        lane.last_forward = LastForward(forward.ended, len(requests), elapsed,
                                        lane.senders_return)
        lane.arrived_at_last_end = lane.arrived
        if watch:
            lane.probe_target = lane.arrived + self.policy.returns_needed(len(requests),
                                                                          batch.lora)
            lane.probe_end = forward.ended + hold
        if forward.error is None:  # the cost model learns; the batch limits may follow
            self.policy.observe(batch.lora, batch.padded_tokens, batch.real_tokens,
                                len(batch.items), elapsed)
            for lora, each in self._lanes.items():  # a LoRA without a fit follows the base
                self._follow_windows(lora, each)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: forward started=%.6f ended=%.6f items=%d requests=%d padded=%d "
                      "senders_return=%s", self.name, forward.started, forward.ended,
                      len(batch.items), len(requests), batch.padded_tokens, lane.senders_return)
        if forward.error is None:
            for pending, value in zip(batch.items, forward.values, strict=True):
                pending.owner.results[pending.item.index] = value  # type: ignore[attr-defined]
            for request, count in owners.items():
                request.remaining -= count
        finished: list[RequestRecord] = []
        for request in requests:
            # An item may join a released batch before the thread takes it.
            dispatched = max(forward.dispatched, request.submitted_at)
            if request.first_dispatch_at is None:
                request.first_dispatch_at = dispatched
            request.inference_s += forward.ended - dispatched
            request.forwards += 1
            if forward.error is not None:
                self._finish(request, forward.error, finished)
            elif request.remaining == 0 or request.future.cancelled():
                self._finish(request, None, finished)
        # Recorded once its requests are answered: the listeners' metric writes are deferred
        # behind the answers (stats.defer), and the counters are current when they wake.
        self.stats.record_batch(BatchRecord(len(batch.items), len(requests),
                                            batch.padded_tokens, batch.lora, elapsed * 1000,
                                            forward.error is not None, forward.started,
                                            forward.ended, batch.real_tokens,
                                            forward.dispatched,  # idle gaps: stats.py
                                            min(map(_ARRIVAL, batch.items)),
                                            forward.ended
                                            + (hold if lane.senders_return else 0.0)))
        if finished:
            self.stats.record_requests(finished)  # one call a forward: listeners batch writes

    def _finish(self, request: _Request, error: BaseException | None,
                finished: list[RequestRecord]) -> None:
        """Resolve `request`, and add its record to `finished`."""
        if request.recorded:
            return
        request.recorded = True
        dispatched = request.first_dispatch_at or self._now()
        queue_ms = (dispatched - request.submitted_at) * 1000
        inference_ms = request.inference_s * 1000
        cancelled = request.future.cancelled()
        if not request.future.done():
            if error is None:
                # Every item ran, so there is nothing to drop: settle here rather than
                # through a callback the loop would schedule for each request.
                if request.on_done is not None:
                    request.future.remove_done_callback(request.on_done)
                self._requests.discard(request)
                request.future.set_result(RequestResult(request.results, queue_ms,
                                                        inference_ms, request.forwards))
                request.release()
            else:
                request.future.set_exception(error)
        finished.append(RequestRecord(len(request.results), queue_ms, inference_ms,
                                      error is not None, cancelled))

    def _on_resolved(self, request: _Request, future: asyncio.Future[RequestResult]) -> None:
        """A request's future is done (result, error or cancellation): drop its items
        that no forward took yet (R9)."""
        self._requests.discard(request)
        lane = self._lanes.get(request.lora)
        if lane is not None and (future.cancelled() or future.exception()):
            # A result means every item already ran.
            in_forwards = request.remaining - self._drop_pending(request, lane)
            if not (request.recorded or in_forwards):
                # Its wait counts too (a timeout's is the queue's tail); one that a forward
                # holds is recorded when that forward ends, with its inference.
                finished: list[RequestRecord] = []
                self._finish(request, None if future.cancelled() else future.exception(),
                             finished)
                self.stats.record_requests(finished)
        request.release()

    def _drop_pending(self, request: _Request, lane: _Lane) -> int:
        """Drop the items of `request` that no forward took yet; return how many."""
        dropped = 0
        if lane.former.holds(request):
            for pending in request.items:
                dropped += lane.former.discard(pending)
            self._queued -= dropped
        with self._lock:
            for batch in (self._slot, self._handed):  # formed, not yet taken by the thread
                if batch is not None and any(p.owner is request for p in batch.items):
                    dropped += batch.remove(request)
            if self._slot is not None and not self._slot.items:
                self._slot, self._released = None, False
            if self._handed is not None and not self._handed.items:
                self._handed = None
        if dropped:
            self.stats.record_dropped(dropped)
            self._wake.set()
        return dropped

    def _fail(self, exc: BaseException) -> None:
        """The loop failed: every accepted request ends with an error, none is lost,
        and submit refuses new work until restart()."""
        failure = WorkerFailed(self.name, exc)
        self._failure = failure
        log.error("%s", failure, exc_info=exc if isinstance(exc, Exception) else None)
        with self._lock:
            self._slot, self._released, self._handed = None, False, None
        finished: list[RequestRecord] = []
        for request in list(self._requests):
            try:
                self._finish(request, failure, finished)
            except Exception:  # a failing callback must not leave the rest unresolved
                if not request.future.done():
                    request.future.set_exception(failure)
        self._requests.clear()
        with contextlib.suppress(Exception):  # nor may a failing listener
            self.stats.record_requests(finished)
        self._lanes.clear()
        self._queued = 0

    # -- small helpers ------------------------------------------------------------------

    def _lane(self, lora: str | None) -> _Lane:
        lane = self._lanes.get(lora)
        if lane is None:
            lane = _Lane(self._new_former(self.config))
            self._follow_windows(lora, lane)  # what is learned holds from its first batch
            self._lanes[lora] = lane
        return lane

    def _follow_windows(self, lora: str | None, lane: _Lane) -> None:
        """The lane's batch limits from the windows learned for `lora`."""
        windows, limits = self.policy.windows(lora), lane.former.limits
        if (windows.max_padding, windows.max_batch_tokens) != (limits.max_padding,
                                                               limits.max_tokens):
            lane.former.limits = replace(limits, max_padding=windows.max_padding,
                                         max_tokens=windows.max_batch_tokens)

    def _lane_requests(self, lora: str | None) -> int:
        """Distinct requests of `lora` not yet dispatched: queued or in the slot."""
        former = self._lanes[lora].former
        slot = self._slot
        if slot is None or slot.lora != lora:
            return former.pending_requests
        in_slot = dict.fromkeys(map(_OWNER, slot.items))
        return former.pending_requests + sum(not former.holds(o) for o in in_slot)

    def _idle(self) -> bool:
        """Nothing formed, running or awaiting delivery."""
        return (self._slot is None and self._in_flight is None and self._handed is None
                and not self._finished
                and not self._stopping and self.running)

    def _drained(self) -> bool:
        with self._lock:
            busy = (self._slot is not None or self._in_flight is not None
                    or self._handed is not None)
        return not busy and not self._finished and self._queued == 0

    async def _join_thread(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._thread_exit = True
            self._cond.notify_all()
        await asyncio.to_thread(thread.join)
        self._thread = None

    @staticmethod
    def _now() -> float:
        # Not loop.time(): uvloop's clock ticks in whole milliseconds, too coarse for
        # windows of 2-3 ms and for the queue times the API reports.
        return time.perf_counter()
