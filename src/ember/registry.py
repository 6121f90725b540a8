"""Model registry: name -> loaded model, lazy loading, LRU eviction under limits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol, cast

from ember import heap, hub
from ember.adapters.base import (
    ModelAdapter,
    ModelInfo,
    Runtime,
    family_loader,
    import_family,
)
from ember.config import (
    CatalogError,
    ModelSpec,
    ServerSettings,
    hub_id,
    hub_spec_on_request,
    resolve_source,
)
from ember.engine import (
    ModelWorker,
    PreparedItem,
    QueueFull,
    RequestResult,
    RequestTooLarge,
    ShuttingDown,
    WorkerConfig,
)
from ember.errors import ModelLoadError, ModelNotFound
from ember.hub import (
    NotDownloaded,
    NotOnHub,
    may_download,
    requests_may_download,
)

log = logging.getLogger("ember.registry")
# A load or eviction leaves the whole-heap collection for when nothing has run this long.
IDLE_COLLECT_AFTER_S = 1.0
LoadFunction = Callable[[ModelSpec, Runtime], ModelAdapter]
WorkerFactory = Callable[..., ModelWorker]  # ModelWorker's own signature, or a subclass


class Preloadable(Protocol):
    async def get(self, name: str) -> object: ...


class Loadable(Preloadable, Protocol):
    def queue_limit(self, name: str) -> int | None: ...


def estimate_bytes(spec: ModelSpec) -> int:
    """Size of the model's files on disk: roughly what loading it will add."""
    if spec.adapter == "synthetic":
        return 0
    try:
        root = resolve_source(spec, download=False)  # never a download on the event loop
    except (FileNotFoundError, OSError):
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def files_here(spec: ModelSpec) -> None:
    """Raise as the load would where the model's files, or the Hub files its folder names
    (a GLiNER's backbone tokenizer), are not here and may not be downloaded."""
    folder = resolve_source(spec)
    try:
        hub.backbone_folder(folder)
    except NotDownloaded as exc:
        raise NotDownloaded(f"model {spec.name} takes its tokenizer from "
                            f"{hub.backbone(folder)}: {exc}") from None


def adapter_loader(family: str) -> LoadFunction:
    """Each family is a module of `ember.adapters` exposing `load(spec, runtime)`."""
    return cast(LoadFunction, family_loader(family, "load"))


def check_room(pending: int, items: int, limit: int) -> None:
    """Refuse a request the queue can never take (RequestTooLarge) or cannot take now
    (QueueFull), given `pending` queued items."""
    if items > limit:
        raise RequestTooLarge(items, limit)
    if pending + items > limit:
        raise QueueFull(pending, items, limit)


@dataclass(eq=False)
class LoadedModel:
    """A model in memory with its worker; `submit` is what task methods call."""

    spec: ModelSpec
    adapter: ModelAdapter
    worker: ModelWorker
    memory_bytes: int
    load_seconds: float
    last_used: float = field(default_factory=time.monotonic)
    in_use: int = 0

    def check_room(self, items: int) -> None:
        """QueueFull, before any tokenizing, when the queue cannot take `items` now (the
        worker checks again, exactly, on submit)."""
        check_room(self.worker.pending_items, items, self.worker.config.max_queue_items)

    async def submit(self, items: Sequence[PreparedItem], params: Hashable,
                     lora: str | None) -> RequestResult:
        # Cancelling this await cancels the engine's future, which drops the request's
        # pending items (R9).
        return await (await self.worker.submit(items, params, lora=lora))


class ModelInUse:
    """Holds a loaded model against eviction while its `async with` block runs. A plain
    class rather than a generator-based context manager: every request enters one."""

    __slots__ = ("_model", "_name", "_registry")

    def __init__(self, registry: Registry, name: str) -> None:
        self._registry = registry
        self._name = name
        self._model: LoadedModel | None = None

    async def __aenter__(self) -> LoadedModel:
        model = await self._registry.get(self._name)
        model.in_use += 1
        model.last_used = time.monotonic()
        self._model = model
        return model

    async def __aexit__(self, *exc: object) -> None:
        if self._model is not None:
            self._model.in_use -= 1
            self._registry.released(self._model)
            self._model = None


@dataclass
class RegistryLimits:
    max_loaded_models: int = 4
    memory_budget_bytes: int | None = None
    failure_retry_s: float = 30.0
    # Never evicted: the default model serves the routes without a model name and /readyz.
    pinned: frozenset[str] = frozenset()


LOOKUP_RETRY_S = 30.0  # a request's Hub id that failed its lookup fails this long at once
LOOKUP_THREADS = 2  # downloads a request started, beside each other, at most
MAX_REMEMBERED_FAILURES = 1024


class HubLookups:
    """The lookups of Hub ids that requests name, which may download: on threads of their
    own (eight slow downloads on the loop's pool held a model on disk from loading for
    three minutes), one a name at a time, and a failure answered again at once for
    LOOKUP_RETRY_S (each request for a failing id called the Hub again)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # made in the process that looks up
        self._running: dict[str, asyncio.Future[ModelSpec]] = {}
        self._failed: dict[str, tuple[float, Exception]] = {}

    async def run(self, name: str, lookup: Callable[[], ModelSpec]) -> ModelSpec:
        failed = self._failed.get(name)
        if failed is not None and time.monotonic() - failed[0] < LOOKUP_RETRY_S:
            raise failed[1].with_traceback(None)  # else each raise lengthens its traceback
        running = self._running.get(name)
        if running is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="ember-hub")
            running = asyncio.get_running_loop().run_in_executor(self._pool, lookup)
            self._running[name] = running
            running.add_done_callback(lambda done: self._done(name, done))
        return await asyncio.shield(running)

    def running(self) -> list[str]:
        """The ids being looked up (downloading) now."""
        return list(self._running)

    def _done(self, name: str, done: asyncio.Future[ModelSpec]) -> None:
        self._running.pop(name, None)
        if done.cancelled() or (failure := done.exception()) is None:
            return
        now = time.monotonic()
        if len(self._failed) >= MAX_REMEMBERED_FAILURES:  # names are the clients' to make up
            self._failed = {k: v for k, v in self._failed.items()
                            if now - v[0] < LOOKUP_RETRY_S}
        if isinstance(failure, Exception):
            self._failed[name] = (now, failure)


class LoadWaiters:
    """The items of requests awaiting a model (its load, or its worker's restart), by
    model: as many as its queue takes may wait; past that a request is refused at once
    (429), and one larger than the queue too (413), not once the load is done."""

    def __init__(self) -> None:
        self._items: Counter[str] = Counter()

    def items(self, name: str) -> int:
        return self._items[name]

    @contextmanager
    def awaiting(self, name: str, items: int, limit: int) -> Iterator[None]:
        check_room(self._items[name], items, limit)
        self._items[name] += items
        try:
            yield
        finally:
            self._items[name] -= items
            if self._items[name] <= 0:
                del self._items[name]


async def get_within_room(models: Loadable, name: str, items: int,
                          waiters: LoadWaiters) -> None:
    """The model's load (or its worker's restart), awaited by `items` counted in `waiters`
    within its queue's room, so that a first load or a reload after an eviction queues no
    more than the worker would. A name the catalog lacks is `get`'s to answer (a 404, or a
    Hub id it looks up)."""
    limit = models.queue_limit(name)
    if limit is None:
        await models.get(name)
        return
    with waiters.awaiting(name, items, limit):
        await models.get(name)


class CatalogLookup:
    """Names in a catalog, and its specs by name (an unknown name is ModelNotFound)."""

    catalog: Mapping[str, ModelSpec]

    @cached_property
    def _hub_lookups(self) -> HubLookups:
        """This catalog's own: its failures are its own to remember."""
        return HubLookups()

    async def find(self, name: str) -> ModelSpec:
        """`spec`, off the event loop where a request's Hub id may download."""
        if name in self.catalog:
            return self.catalog[name]
        return await self._hub_lookups.run(name, lambda: self.spec(name))

    @property
    def names(self) -> list[str]:
        return sorted(self.catalog)

    def unfinished(self) -> list[str]:
        """The models still being downloaded or loaded (none awaited once a drain ends)."""
        return sorted({*self._hub_lookups.running(), *self._loads_running()})

    def _loads_running(self) -> list[str]:
        return []

    def spec(self, name: str) -> ModelSpec:
        """The entry by that name; a Hub id the catalog lacks is added (downloading it)
        only when the server allows it (--allow-hub-models)."""
        try:
            return self.catalog[name]
        except KeyError:
            pass
        if (same := next((k for k in self.catalog if k.lower() == name.lower()), None)):
            # The Hub's ids ignore case; a second copy would download and serve it again,
            # without its entry's settings (BGE's query instruction).
            raise ModelNotFound(name, self.names, f"model {name!r} is not in the catalog; "
                                f"did you mean {same!r}? (names match exactly, case too)")
        try:
            found = hub_spec_on_request(name)
        except (NotOnHub, NotDownloaded) as exc:  # no model here: not a fault
            raise ModelNotFound(name, self.names, str(exc)) from None
        except (FileNotFoundError, CatalogError) as exc:
            raise ModelLoadError(name, str(exc)) from None
        if found is None:
            ref = hub_id(name)
            if ref is not None and ref.revision is not None and requests_may_download():
                raise ModelNotFound(name, self.names, f"model {name!r}: a request may not "
                                    "name a Hub revision; pin it when the server starts "
                                    f"(--model {name}), or name {ref.repo}") from None
            hint = ""
            if ref is not None:  # a request may fetch no revision (above)
                fetch = "" if ref.revision else (
                    ", or when it lets requests fetch models (--allow-hub-models)")
                hint = (f"a Hub model is served when the server's start names it "
                        f"(--model {name} or --preload {name}){fetch}; ")
            raise ModelNotFound(name, self.names, hint=hint) from None
        cast(dict[str, ModelSpec], self.catalog)[name] = found
        return found


class Registry(CatalogLookup):
    """Loads catalog models on first use; concurrent first requests load once."""

    @classmethod
    def serving(cls, settings: ServerSettings, catalog: Mapping[str, ModelSpec]) -> Registry:
        """The registry `ember serve` runs with these settings."""
        budget = settings.memory_budget_mb * 1024 * 1024 if settings.memory_budget_mb else None
        return cls(catalog, Runtime.from_settings(settings), settings.worker,
                   RegistryLimits(settings.max_loaded_models, budget,
                                  pinned=frozenset({settings.default_model})))

    def __init__(self, catalog: Mapping[str, ModelSpec], runtime: Runtime | None = None,
                 worker_config: WorkerConfig | None = None,
                 limits: RegistryLimits | None = None,
                 loader: Callable[[str], LoadFunction] = adapter_loader,
                 worker: WorkerFactory = ModelWorker) -> None:
        self.catalog = dict(catalog)
        self.runtime = runtime or Runtime()
        self.worker_config = worker_config or WorkerConfig()
        self.limits = limits or RegistryLimits()
        self._loader = loader
        self._new_worker = worker  # how each loaded model's worker is made
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Future[LoadedModel]] = {}
        # Loads under way, by their estimated bytes: counted against the limits, so that
        # models asked for at once do not all pass the check before any is loaded.
        self._incoming: dict[str, int] = {}
        # Requests awaiting a model's load: it is not idle for eviction until they hold it.
        self._awaited: Counter[str] = Counter()
        self._failures: dict[str, tuple[float, ModelLoadError]] = {}
        self.on_load: list[Callable[[LoadedModel], None]] = []
        self.on_evict: list[Callable[[str], None]] = []
        self.on_load_failure: list[Callable[[str], None]] = []
        self.on_absent: list[Callable[[str], None]] = []  # asked for, its files not here
        self.on_worker: list[Callable[[LoadedModel], None]] = []
        self.closing = False
        self._idle_collection: asyncio.Task[None] | None = None
        self._shrinking: asyncio.Task[None] | None = None

    @property
    def loaded(self) -> dict[str, LoadedModel]:
        return dict(self._loaded)

    def state(self, name: str) -> str:
        """loaded | loading | failed | available"""
        if name in self._loaded:
            return "loaded"
        if name in self._loading:
            return "loading"
        return "failed" if name in self._failures else "available"

    def info(self, name: str) -> ModelInfo | None:
        model = self._loaded.get(name)
        return model.adapter.info if model is not None else None

    def dispatch(self, name: str) -> dict[str, Any] | None:
        """A loaded model's learned cost per forward and dispatch windows."""
        model = self._loaded.get(name)
        return model.worker.policy.describe() if model is not None else None

    async def refresh(self) -> None:
        """Nothing to do: this registry's state is always current."""

    def busy_within(self, seconds: float) -> bool:
        """Always: the engine is this process, and its status is never late."""
        return True

    def _loads_running(self) -> list[str]:
        return [name for name, load in self._loading.items() if not load.done()]

    def queue_limit(self, name: str) -> int | None:
        """The queue's size of a catalog model; None for a name the catalog lacks."""
        spec = self.catalog.get(name)
        return None if spec is None else spec.worker_config(self.worker_config).max_queue_items

    def ready(self, name: str) -> LoadedModel | None:
        """The model if it is loaded and its worker can take work now, else None (then
        `use` or `get` loads it, or restarts its worker)."""
        model = self._loaded.get(name)
        if model is None or model.worker.failure is not None:
            return None
        return model

    def use(self, name: str) -> ModelInUse:
        """`async with registry.use(name) as model`: the loaded model, held against
        eviction for the duration of a request."""
        return ModelInUse(self, name)

    async def get(self, name: str) -> LoadedModel:
        spec = await self.find(name)
        if (model := self._loaded.get(name)) is not None:
            if model.worker.failure is not None:  # its loop failed: a fresh one serves on
                log.warning("restarting the worker of %s: %s", name, model.worker.failure)
                with self._awaiting(name):  # not evicted (its adapter closed) meanwhile
                    await model.worker.restart()
            return model
        failure = self._failures.get(name)
        if failure and time.monotonic() - failure[0] < self.limits.failure_retry_s:
            raise failure[1].with_traceback(None)  # remembered: its traceback must not grow
        pending = self._loading.get(name)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._loading[name] = pending
            asyncio.get_running_loop().create_task(self._load(spec, pending))
        with self._awaiting(name):  # the caller takes hold of it before any eviction
            return await asyncio.shield(pending)

    @contextmanager
    def _awaiting(self, name: str) -> Iterator[None]:
        """A request awaits the model (its load, its worker's restart): it is not idle."""
        self._awaited[name] += 1
        try:
            yield
        finally:
            self._awaited[name] -= 1
            if not self._awaited[name]:
                del self._awaited[name]

    async def preload(self, names: Sequence[str]) -> None:
        for name in names:
            await self.get(name)

    async def close(self) -> None:
        """Drain every worker (nothing accepted is lost), then release the models."""
        self.closing = True
        for name in list(self._loaded):
            await self._evict(name, "the server stops")
        if self._idle_collection is not None:
            self._idle_collection.cancel()
        heap.settle()

    async def _load(self, spec: ModelSpec, done: asyncio.Future[LoadedModel]) -> None:
        adapter: ModelAdapter | None = None
        worker: ModelWorker | None = None
        try:
            # A model whose files are not here evicts nothing (the synthetic one has none).
            if spec.adapter != "synthetic" and not may_download():
                await asyncio.to_thread(files_here, spec)
            self._incoming[spec.name] = estimate_bytes(spec)
            await self._make_room(spec.name)
            log.info("loading model %s (%s adapter) ...", spec.name, spec.adapter)
            started = time.monotonic()
            # The family's module is imported in a thread: torch alone takes seconds,
            # which on the loop would hold every request of the process.
            await asyncio.to_thread(import_family, spec.adapter)
            load = self._loader(spec.adapter)
            adapter = await asyncio.to_thread(load, spec, self.runtime)
            seconds = time.monotonic() - started
            memory = adapter.memory_bytes()
            config = replace(spec.worker_config(self.worker_config),
                             forward_fills_cores=adapter.fills_host_cores)
            worker = self._new_worker(adapter, config, name=spec.name)
            await worker.start()
            model = LoadedModel(spec, adapter, worker, memory, seconds)
            for hook in self.on_worker:
                hook(model)
            self._loaded[spec.name] = model
            self._failures.pop(spec.name, None)
            log.info("loaded model %s in %.1f s (%.0f MB)", spec.name, seconds,
                     model.memory_bytes / 1e6)
            for hook in self.on_load:
                hook(model)
            done.set_result(model)
        except NotDownloaded as exc:
            # A model this server does not have: the request's 404, not a load failure.
            log.info("model %s was asked for and is not here: %s", spec.name, exc)
            for absent in self.on_absent:
                absent(spec.name)
            done.set_exception(ModelNotFound(spec.name, self.names, str(exc)))
            done.exception()
        except Exception as exc:
            if adapter is not None and spec.name not in self._loaded:
                # Nothing of a load that failed stays running or in memory.
                if worker is not None:
                    await worker.stop()
                adapter.close()
            cause = exc.cause if isinstance(exc, ModelLoadError) else \
                f"{type(exc).__name__}: {exc}"
            error = ModelLoadError(spec.name, f"{cause} (a request tries the load again "
                                              f"{self.limits.failure_retry_s:g} s after it failed)")
            log.error("%s", error)
            self._failures[spec.name] = (time.monotonic(), error)
            for failed in self.on_load_failure:
                failed(spec.name)
            done.set_exception(error)
            done.exception()  # mark retrieved: a load nobody awaits any more is not an error
        finally:
            self._loading.pop(spec.name, None)
            self._incoming.pop(spec.name, None)
            heap.freeze_new()  # what the load made leaves the collector's generations
            self._collect_when_idle()  # its garbage, and any evicted model's cycles

    def _over(self) -> bool:
        """Whether the loaded models and those loading pass the limits."""
        limits = self.limits
        if len(self._loaded) + len(self._incoming) > limits.max_loaded_models:
            return True
        budget = limits.memory_budget_bytes
        return budget is not None and (sum(m.memory_bytes for m in self._loaded.values())
                                       + sum(self._incoming.values()) > budget)

    def _limit_passed(self) -> str:
        """The limit the loaded and loading models pass, as the user set it."""
        limits = self.limits
        if len(self._loaded) + len(self._incoming) > limits.max_loaded_models:
            return f"--max-loaded-models {limits.max_loaded_models}"
        return f"--memory-budget-mb {(limits.memory_budget_bytes or 0) // 2**20}"

    async def _make_room(self, loading: str) -> None:
        """Evict least recently used idle models until the loading ones fit the limits."""
        while self._over():
            if not await self._evict_idle(f"room for {loading} ({self._limit_passed()})"):
                log.warning("over the model limits but every loaded model is busy or "
                            "pinned (the default model); loading anyway, and evicting "
                            "down to the limits once they are idle")
                return

    async def _evict_idle(self, why: str) -> bool:
        """Evict the least recently used idle model that is not pinned; False if none."""
        idle = [m for m in self._loaded.values() if m.in_use == 0 and m.spec.name not in
                self.limits.pinned and m.spec.name not in self._awaited]
        if not idle:
            return False
        least = min(idle, key=lambda m: m.last_used)
        await self._evict(least.spec.name, f"{why}; the idle model used least recently "
                          f"({time.monotonic() - least.last_used:.0f} s ago)")
        return True

    def released(self, model: LoadedModel) -> None:
        """A request let go of `model`: once it is idle, a registry that loaded past its
        limits (every model was busy then) evicts back down to them."""
        if model.in_use == 0 and self._over() and (
                self._shrinking is None or self._shrinking.done()):
            self._shrinking = asyncio.get_running_loop().create_task(self._shrink())

    async def _shrink(self) -> None:
        while self._over() and not self.closing and await self._evict_idle(
                f"back within {self._limit_passed()}"):
            pass

    async def _evict(self, name: str, why: str) -> None:
        model = self._loaded.pop(name)
        log.info("evicting model %s: %s (draining its queue first)", name, why)
        started = time.monotonic()
        await model.worker.stop()
        model.adapter.close()
        log.info("evicted model %s in %.2f s (%.0f MB freed)", name,
                 time.monotonic() - started, model.memory_bytes / 1e6)
        for hook in self.on_evict:
            hook(name)
        self._collect_when_idle()  # the model's reference cycles are frozen until then

    def _collect_when_idle(self) -> None:
        if self._idle_collection is None or self._idle_collection.done():
            self._idle_collection = asyncio.get_running_loop().create_task(
                self._collect_once_idle(), name="idle-collection")

    def _busy(self) -> bool:
        return bool(self._loading) or any(m.in_use for m in self._loaded.values())

    async def _collect_once_idle(self) -> None:
        """The whole-heap collection, run once no request has been in flight and no load
        under way for IDLE_COLLECT_AFTER_S: an arrival meets at most one such walk."""
        quiet_since: float | None = None
        while not self.closing:
            await asyncio.sleep(IDLE_COLLECT_AFTER_S / 4)
            now = time.monotonic()
            if self._busy():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= IDLE_COLLECT_AFTER_S:
                started = time.perf_counter()
                heap.collect_all()
                log.debug("idle collection in %.0f ms", (time.perf_counter() - started) * 1e3)
                return


async def preload_models(models: Preloadable, names: Sequence[str],
                         starting: Callable[[str], None] | None = None) -> None:
    """Load each named model once, in order, telling `starting` each as its turn comes; a
    failure is logged and the server stays up (the model's routes then say why)."""
    for name in dict.fromkeys(names):
        if starting is not None:
            starting(name)
        try:
            await models.get(name)
        except ShuttingDown:  # a stop during the load: the operator's order, not a fault
            log.info("preload of %s given up: the server is stopping", name)
            return
        except Exception as exc:
            log.error("could not preload %s: %s", name, exc)
