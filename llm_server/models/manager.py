"""Loads registered models on demand, one at a time on a loader thread, within a memory budget.

Everything here runs on the event loop except the loads and unloads themselves, so a slot's
status, counts and the budget change atomically between awaits. Each loaded model has its own
ModelService (its own scheduler thread), so a load never stalls another model's decode steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import itertools
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llm_server.engines.kv.budget import Account, MemoryBudget
from llm_server.models.checkpoint import CheckpointError, check_checkpoint
from llm_server.models.memory import ModelSize, format_bytes
from llm_server.models.registry import ModelEntry
from llm_server.models.slots import (
    InsufficientMemory,
    ModelBusy,
    ModelError,
    ModelInUse,
    ModelLoadFailed,
    ModelNotFound,
    ModelSlot,
    ModelTooLarge,
    Status,
)
from llm_server.service import ModelService
from llm_server.settings import DEFAULT_LOAD_WAIT_S

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.25  # how often idle TTLs are checked
CLOSE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ManagerConfig:
    budget: int  # bytes all loaded models may hold together (what they hold, measured)
    idle_unload: float | None = None  # seconds idle before an unpinned model unloads
    max_waiting: int = 16  # requests that may wait for one model's load before 429
    # seconds a load waits for a loaded model to go idle (then evicts it) before 503
    load_wait: float = DEFAULT_LOAD_WAIT_S


# (entry, resolved path, its estimate, its budget account) -> a started service (its engine
# loads on its scheduler thread, at the estimate's context unless the entry sets one)
ServiceFactory = Callable[[ModelEntry, Path, ModelSize, Account], ModelService]
SizeEstimator = Callable[[ModelEntry, Path], ModelSize]


class ModelManager:
    """The registry's models and their loaded services."""

    def __init__(
        self,
        entries: list[ModelEntry],
        config: ManagerConfig,
        factory: ServiceFactory,
        estimate: SizeEstimator,
        resolve: Callable[[str], Path],
    ) -> None:
        self.budget = MemoryBudget(config.budget)  # what every model holds, measured
        self.budget.evict_idle = self._evict_idle_from_thread
        self.slots = {e.id: ModelSlot(e, budget=self.budget) for e in entries}
        self._names = {name: e.id for e in entries for name in e.names}
        self.default_id = entries[0].id
        self.config = config
        self._factory, self._estimate, self._resolve = factory, estimate, resolve
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="llm-model-loader")
        self._lock = asyncio.Lock()  # one load (with its evictions) at a time
        self._wanting_room = False  # the load holding the lock waits for a model to go idle
        self._loading: ModelSlot | None = None  # the slot whose load holds the lock
        self._freed = asyncio.Event()  # set when a model goes idle or an unload starts
        self._closing = False  # close() began: a load waiting for room gives up
        self._seq = itertools.count(1)
        self._listeners: list[Callable[[str, ModelService], None]] = []
        self._reaper: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran on

    # -- looking up ------------------------------------------------------------------

    def slot(self, name: str | None) -> ModelSlot:
        """The slot a request's `model` names (absent or "default": the first entry)."""
        if name is None or name == "default":
            return self.slots[self.default_id]
        model_id = self._names.get(name)
        if model_id is None:
            known = ", ".join(sorted(self.slots))
            raise ModelNotFound(f"model {name!r} does not exist; this server serves: {known}")
        return self.slots[model_id]

    def used(self) -> int:
        """Bytes counted against the budget now: what loaded models hold (each at least its
        weights and first row), and what a load under way needs."""
        return self.budget.used()

    def on_loaded(self, listener: Callable[[str, ModelService], None]) -> None:
        """Call `listener(model_id, service)` whenever a model finishes loading."""
        self._listeners.append(listener)

    # -- requests --------------------------------------------------------------------

    async def acquire(self, name: str | None) -> ModelSlot:
        """The slot for `name` with its service ready, held until release(); loads it first
        when needed (waiting in its bounded queue) and raises ModelError when it cannot."""
        slot = self.slot(name)
        while slot.status is not Status.LOADED:
            if slot.waiting >= self.config.max_waiting:
                raise ModelBusy(
                    f"{slot.waiting} requests already wait for model {slot.entry.id!r} to "
                    f"load (at most {self.config.max_waiting}: --max-queued); retry shortly"
                )
            slot.waiting += 1
            try:
                await asyncio.shield(self._transition(slot))
            except BaseException:  # this request leaves without the model (an error, a drop)
                slot.waiting -= 1
                self._maybe_evict(slot)
                raise
            slot.waiting -= 1  # and takes it below, before any other coroutine runs
        slot.active += 1
        slot.expires = None
        return slot

    def release(self, slot: ModelSlot, keep_alive: float | None = None) -> None:
        """A request let go of `slot`; `keep_alive` (seconds; 0 unloads now, negative keeps it
        loaded) overrides the model's idle TTL, as Ollama's field does."""
        slot.active -= 1
        slot.last_used = time.time()
        slot.used_seq = next(self._seq)
        ttl = keep_alive
        if ttl is None:
            ttl = (
                slot.entry.idle_ttl if slot.entry.idle_ttl is not None else self.config.idle_unload
            )
        if slot.entry.pinned or ttl is None or ttl < 0:
            slot.expires = None
        else:
            slot.expires = time.monotonic() + ttl
            if ttl == 0 and slot.idle() and slot.status is Status.LOADED:
                self._start_unload(slot)
        self._maybe_evict(slot)

    def _maybe_evict(self, slot: ModelSlot) -> None:
        """`slot` may have gone idle: a load waiting for room evicts it before a new request
        takes it."""
        evictable = slot.idle() and slot.status is Status.LOADED and not slot.entry.pinned
        if self._wanting_room and evictable:
            log.info("%s went idle: evicting it for the load waiting for room", slot.entry.id)
            self._start_unload(slot)

    # -- loading and unloading -------------------------------------------------------

    def _transition(self, slot: ModelSlot) -> asyncio.Task:
        """The load (or the unload, then a load) in progress for `slot`, started if none.

        A finished task counts as none: its done callback (which clears `slot.task`) runs a
        loop turn after it finishes, and a request arriving in between must get a pending task
        to await; awaiting the finished one returns without yielding, so acquire() would spin
        on the event loop forever with the callback never run (the load queue's stall)."""
        if slot.task is None or slot.task.done():
            slot.task = asyncio.ensure_future(self._load(slot))
            slot.task.add_done_callback(lambda t: _finished(slot, t))
        return slot.task

    async def load(self, name: str) -> ModelSlot:
        """Load `name` now (POST /v1/models/{id}/load); returns once it serves."""
        slot = self.slot(name)
        while slot.status is not Status.LOADED:
            await asyncio.shield(self._transition(slot))
        slot.last_used = time.time()
        slot.used_seq = next(self._seq)
        return slot

    async def unload(self, name: str) -> ModelSlot:
        """Unload `name` now; ModelError (409) while requests use it."""
        slot = self.slot(name)
        if slot.task is not None:
            with contextlib.suppress(ModelError):
                await asyncio.shield(slot.task)
        if slot.status is Status.LOADED:
            if not slot.idle():
                raise ModelInUse(f"model {slot.entry.id!r} has {slot.active} running requests")
            await asyncio.shield(self._start_unload(slot))
        return slot

    async def _load(self, slot: ModelSlot) -> None:
        slot.status = Status.LOADING  # queued behind other loads, or loading
        started = time.monotonic()
        deadline = started + self.config.load_wait  # queueing and waiting for room, together
        try:
            await self._take_loader(slot, deadline)
        except BaseException:
            slot.status = Status.UNLOADED
            raise
        try:
            entry = slot.entry
            slot.error = None
            self._loading = slot
            started = time.monotonic()  # the load itself, for the log
            try:
                service = await self._load_locked(slot, deadline)
            except BaseException as exc:
                slot.status, slot.size, slot.service = Status.UNLOADED, None, None
                self.budget.close(slot.entry.id)
                if isinstance(exc, (ModelError, CheckpointError)):
                    slot.error = str(exc)  # says what is wrong already
                else:
                    slot.error = _reason(exc)
                log.error("model %s failed to load: %s", entry.id, slot.error)
                if isinstance(exc, ModelError):
                    raise
                raise ModelLoadFailed(f"model {entry.id!r} failed to load: {slot.error}") from exc
            slot.service, slot.status = service, Status.LOADED
            slot.loaded_at = slot.last_used = time.time()
            slot.used_seq = next(self._seq)
            log.info(
                "loaded %s in %.1fs (%s; %s of %s in use)",
                entry.id,
                time.monotonic() - started,
                format_bytes(slot.size.total),
                format_bytes(self.used()),
                format_bytes(self.config.budget),
            )
            for listener in self._listeners:
                listener(entry.id, service)
        finally:
            self._loading = None
            self._lock.release()

    async def _take_loader(self, slot: ModelSlot, deadline: float) -> None:
        """Take the loader (one load at a time) by `deadline` (monotonic seconds), else
        InsufficientMemory: a load queued behind one that waits for room waits no longer in
        all than --load-wait."""
        if not self._lock.locked():
            await self._lock.acquire()
            return
        try:
            await asyncio.wait_for(self._lock.acquire(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            ahead = self._loading.entry.id if self._loading is not None else "another model"
            raise InsufficientMemory(
                f"model {slot.entry.id!r} waited {self.config.load_wait:g}s behind the load "
                f"of {ahead!r} (one load at a time, waiting for room while the loaded models "
                "serve requests); retry later"
            ) from None

    async def _load_locked(self, slot: ModelSlot, deadline: float) -> ModelService:
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(self._loader, self._resolve, slot.entry.source)
        slot.path = path
        # a corrupt, truncated or mismatched file fails here, before any model is evicted
        await loop.run_in_executor(self._loader, check_checkpoint, path)
        try:
            size = await loop.run_in_executor(self._loader, self._estimate, slot.entry, path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadFailed(
                f"model {slot.entry.id!r} failed to load: cannot read its files ({_reason(exc)})"
            ) from exc
        if size.needed > self.config.budget:
            raise ModelTooLarge(slot.entry.id, size, self.config.budget)
        await self._make_room(slot, size, deadline)
        slot.size = size
        self.budget.reserve_floor(slot.entry.id, size.needed)  # counted from here on
        account = self.budget.account(slot.entry.id, slot.entry.pinned)
        return await loop.run_in_executor(
            self._loader, self._start, slot.entry, path, size, account
        )

    def _start(
        self, entry: ModelEntry, path: Path, size: ModelSize, account: Account
    ) -> ModelService:
        """On the loader thread: a started service with its engine loaded."""
        service = self._factory(entry, path, size, account)
        try:
            service.wait_ready()
        except BaseException:
            service.close(5)
            raise
        return service

    async def _make_room(self, slot: ModelSlot, size: ModelSize, deadline: float) -> None:
        """Unload least recently used, idle, unpinned models until `size` fits the budget;
        while every other model serves requests, wait (until `deadline`, monotonic seconds)
        for the first to go idle, and evict it (`release`)."""
        pinned = sum(s.counted for s in self.slots.values() if s is not slot and s.entry.pinned)
        if pinned + size.needed > self.config.budget:
            raise InsufficientMemory(
                f"model {slot.entry.id!r} needs {format_bytes(size.needed)} but pinned models "
                f"hold {format_bytes(pinned)} of the {format_bytes(self.config.budget)} "
                "budget; unpin a model or raise --max-memory"
            )
        while self.used() + size.needed > self.config.budget:
            self._freed.clear()
            victims = [
                s
                for s in self.slots.values()
                if s is not slot and s.status is Status.LOADED and s.idle() and not s.entry.pinned
            ]
            freeing = [s.task for s in self.slots.values() if s.status is Status.UNLOADING]
            if not victims and freeing:  # an unload under way returns its bytes first
                await asyncio.wait([t for t in freeing if t is not None])
                continue
            if not victims:
                await self._wait_for_idle(slot, size, deadline)
                continue
            victim = min(victims, key=lambda s: s.used_seq)
            log.info("evicting %s (least recently used) to load %s", victim.entry.id, slot.entry.id)
            await self._start_unload(victim)

    async def _wait_for_idle(self, slot: ModelSlot, size: ModelSize, deadline: float) -> None:
        """Wait until a model goes idle or starts unloading; InsufficientMemory past
        `deadline` (monotonic seconds)."""
        left = deadline - time.monotonic()
        if left > 0 and not self._closing:
            log.info("%s waits for room: every other model serves requests", slot.entry.id)
            self._wanting_room = True
            try:
                await asyncio.wait_for(self._freed.wait(), left)
                return
            except TimeoutError:
                pass
            finally:
                self._wanting_room = False
        if self._closing:
            raise InsufficientMemory(
                f"the server is shutting down; model {slot.entry.id!r} not loaded"
            )
        busy = [s for s in self.slots.values() if s.counted and s is not slot]
        held = ", ".join(
            f"{s.entry.id} {format_bytes(s.counted)}, {s.active} requests" for s in busy
        )
        raise InsufficientMemory(
            f"model {slot.entry.id!r} needs {format_bytes(size.needed)} but "
            f"{format_bytes(self.used())} of the {format_bytes(self.config.budget)} budget is "
            f"held by models that are pinned or serving ({held}), and none went idle in "
            f"{self.config.load_wait:g}s; retry later"
        )

    def _start_unload(self, slot: ModelSlot) -> asyncio.Task:
        slot.status = Status.UNLOADING
        self._freed.set()
        slot.task = asyncio.ensure_future(self._unload(slot))
        slot.task.add_done_callback(lambda t: _finished(slot, t))
        return slot.task

    async def _unload(self, slot: ModelSlot) -> None:
        held = [slot.service] if slot.service is not None else []
        slot.service = None
        self.budget.close(slot.entry.id)  # before the collection: it refers to the engine
        await asyncio.to_thread(_close_and_release, held)
        slot.status, slot.size, slot.expires = Status.UNLOADED, None, None
        log.info("unloaded %s (%s in use)", slot.entry.id, format_bytes(self.used()))

    # -- room for a model's KV (asked from its engine thread) ---------------------------

    def _evict_idle_from_thread(self, nbytes: int, asker: str) -> int:
        """Unload idle unpinned models other than `asker` until `nbytes` are freed (least
        recently used first); bytes freed. Runs the unloads on the loop and waits for them
        (a model's scheduler thread asks, when its KV store must grow)."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._closing:
            return 0
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                return 0  # never block the loop on itself
        future = asyncio.run_coroutine_threadsafe(self._evict_idle(nbytes, asker), loop)
        try:
            return future.result(CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no room made: the growth is refused instead
            future.cancel()
            return 0

    async def _evict_idle(self, nbytes: int, asker: str) -> int:
        freed = 0
        while freed < nbytes:
            victims = [
                s
                for s in self.slots.values()
                if s.entry.id != asker
                and s.status is Status.LOADED
                and s.idle()
                and not s.entry.pinned
            ]
            if not victims:
                break
            victim = min(victims, key=lambda s: s.used_seq)
            held = self.budget.counted(victim.entry.id)
            log.info("evicting %s (idle, least recently used) for %s's KV", victim.entry.id, asker)
            await self._start_unload(victim)
            freed += held
        return freed

    # -- background ------------------------------------------------------------------

    def start(self) -> None:
        """Load the pinned models and start the idle reaper (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        for slot in self.slots.values():
            if slot.entry.pinned:
                self._transition(slot)
        self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for slot in self.slots.values():
                expired = slot.expires is not None and slot.expires <= now
                if expired and slot.status is Status.LOADED and slot.idle():
                    log.info("%s idle past its TTL: unloading", slot.entry.id)
                    self._start_unload(slot)

    async def close(self) -> None:
        """Stop the reaper and close every loaded service (each drains its requests)."""
        if self._reaper is not None:
            self._reaper.cancel()
        self._closing = True
        self._freed.set()  # a load waiting for room gives up
        for slot in self.slots.values():
            if slot.task is not None:
                with contextlib.suppress(BaseException):
                    await slot.task
            if slot.service is not None:
                await asyncio.to_thread(_close, slot.service)
                slot.service, slot.status = None, Status.UNLOADED
        self._loader.shutdown(wait=False)


def _finished(slot: ModelSlot, task: asyncio.Task) -> None:
    if slot.task is task:
        slot.task = None
    if not task.cancelled():
        task.exception()  # retrieved: a failed load is reported to its waiters and in /v1/models


def _close(service: ModelService) -> None:
    service.close(CLOSE_TIMEOUT_S)


def _close_and_release(held: list[ModelService]) -> None:
    """Close the service in `held` (emptied: no reference survives the call), then return
    its memory."""
    if held:
        _close(held.pop())
    release_memory()


def release_memory() -> None:
    """Return freed arrays to the system: collect cycles, empty MLX's buffer cache, and on
    glibc trim the malloc arenas (freed weights stay resident in them otherwise)."""
    gc.collect()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except (ImportError, AttributeError):
        pass
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
