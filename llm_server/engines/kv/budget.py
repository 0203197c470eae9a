"""The memory budget every model of the process shares: bytes held now, by model and kind, and
the question each growth asks first (`Account.reserve`).

Held bytes are measured, not estimated: each model's account reads its engine's arrays
(`measure`: weights, KV store and states, prefix cache) whenever the budget sums them, so what
is counted is what is allocated. A growth asks for the bytes of its new arrays while the old
ones are still held (a store growth copies: the peak is old + new). When they do not fit, the
budget makes room: idle models are evicted first (the manager's `evict_idle`), then this
model's own prefix-cache entries (`shrink`); what still does not fit is refused
(`BudgetRefused`, a 503 with Retry-After at the HTTP layer). Thread-safe: engines ask from
their scheduler threads, the manager reads from the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

REFUSED = "memory budget:"  # how a refused growth's message starts (the API answers 503)
RETRY_AFTER_S = 5  # what a refused request is told to wait


@dataclass(frozen=True)
class HeldBytes:
    """Bytes a loaded model holds now, by kind."""

    weights: int = 0
    kv: int = 0  # the KV store's rows (serving, scoring, drafts) and recurrent states
    prefix_cache: int = 0  # the prefix cache's entries in memory

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.prefix_cache

    def as_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "kv": self.kv,
            "prefix_cache": self.prefix_cache,
            "total": self.total,
        }


class BudgetRefused(RuntimeError):
    """A growth the budget cannot make room for; the message names the numbers."""


class MemoryBudget:
    """`limit` bytes that every model's account draws on."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"the memory budget must be > 0 bytes, got {limit}")
        self.limit = limit
        self._lock = threading.RLock()
        self._accounts: dict[str, Account] = {}
        # what each loaded (or loading) model is promised whatever it holds: its weights and
        # one row's first positions (ModelSize.needed; the manager's, none for one model)
        self._reserved: dict[str, int] = {}
        # evict_idle(nbytes, asker) -> bytes freed: unload idle unpinned models other than
        # `asker` (the manager's; None: nothing else to evict, one model)
        self.evict_idle: Callable[[int, str], int] | None = None

    def account(self, model_id: str, pinned: bool = False) -> Account:
        """The account `model_id`'s engine draws on (replaces an earlier one of that id)."""
        with self._lock:
            account = Account(self, model_id, pinned)
            self._accounts[model_id] = account
            return account

    def close(self, model_id: str) -> None:
        """`model_id` unloaded: it holds nothing any more (and its account lets go of the
        engine, whose arrays are then freed with it)."""
        with self._lock:
            account = self._accounts.pop(model_id, None)
            self._reserved.pop(model_id, None)
        if account is not None:
            account.measure = account.shrink = None

    def reserve_floor(self, model_id: str, nbytes: int) -> None:
        """Count at least `nbytes` for `model_id` from now on (a load's needed bytes)."""
        with self._lock:
            self._reserved[model_id] = nbytes

    def floor(self, model_id: str) -> int:
        with self._lock:
            return self._reserved.get(model_id, 0)

    def held(self) -> dict[str, HeldBytes]:
        """Bytes each model with an attached engine holds now."""
        with self._lock:
            accounts = list(self._accounts.values())
        return {a.model_id: a.held() for a in accounts}

    def counted(self, model_id: str) -> int:
        """What the budget counts for `model_id`: the bytes it holds, at least its floor."""
        with self._lock:
            account = self._accounts.get(model_id)
            floor = self._reserved.get(model_id, 0)
        held = account.held().total if account is not None else 0
        return max(held, floor)

    def ids(self) -> list[str]:
        """The models counted now (loaded or loading)."""
        with self._lock:
            return sorted(set(self._accounts) | set(self._reserved))

    def used(self) -> int:
        """Bytes counted now over every model."""
        return sum(self.counted(i) for i in self.ids())

    def pinned_elsewhere(self, model_id: str) -> int:
        """Bytes pinned models other than `model_id` hold (never evicted to make room)."""
        with self._lock:
            pinned = [a for a in self._accounts.values() if a.pinned and a.model_id != model_id]
        return sum(a.held().total for a in pinned)


class Account:
    """One model's draw on the budget: what it holds (`measure`) and what it asks for."""

    def __init__(self, budget: MemoryBudget, model_id: str, pinned: bool) -> None:
        self.budget = budget
        self.model_id = model_id
        self.pinned = pinned
        self.measure: Callable[[], HeldBytes] | None = None  # the engine's held_bytes
        # shrink(nbytes) -> bytes freed from this model's prefix cache (on its engine thread)
        self.shrink: Callable[[int], int] | None = None

    def held(self) -> HeldBytes:
        return self.measure() if self.measure is not None else HeldBytes()

    def room(self, weights: int | None = None) -> int:
        """Bytes of KV and prefix cache this model could ever hold: the budget less its
        `weights` (None: as measured) and what pinned models hold (idle models and caches can
        be evicted)."""
        weights = self.held().weights if weights is None else weights
        return self.budget.limit - weights - self.budget.pinned_elsewhere(self.model_id)

    def reserve(self, nbytes: int, evict: bool = True, own_cache: bool = True) -> bool:
        """May this model allocate `nbytes` more now? Makes room first: (`evict`) idle models,
        then (`own_cache`) this model's prefix-cache entries. Called on the engine's thread;
        a prefix-cache entry asks with neither (the cache evicts its own entries, and an idle
        model is worth more than a cached prefix)."""
        over = self._over(nbytes)
        if over <= 0:
            return True
        if evict and self.budget.evict_idle is not None:
            self.budget.evict_idle(over, self.model_id)
            over = self._over(nbytes)
        if over > 0 and own_cache and self.shrink is not None:
            self.shrink(over)
            over = self._over(nbytes)
        return over <= 0

    def _over(self, nbytes: int) -> int:
        """Bytes past the limit if this model held `nbytes` more (within its floor: none)."""
        budget = self.budget
        held, floor = self.held().total, budget.floor(self.model_id)
        grows = max(held + nbytes, floor) - max(held, floor)
        return budget.used() + grows - budget.limit

    def refused(self, what: str, nbytes: int) -> BudgetRefused:
        """The error for a growth of `nbytes` that did not fit (names the numbers)."""
        budget = self.budget
        held = ", ".join(f"{mid} {format_bytes(budget.counted(mid))}" for mid in budget.ids())
        return BudgetRefused(
            f"{REFUSED} {what} of model {self.model_id!r} needs {format_bytes(nbytes)} "
            f"({nbytes} bytes) more but {format_bytes(budget.used())} of the "
            f"{format_bytes(budget.limit)} budget is held ({held}) and nothing idle could be "
            f"evicted; retry in {RETRY_AFTER_S}s"
        )


def format_bytes(n: int) -> str:
    """`n` bytes as people read them: 1.5G, 513.1M, 12.0K, 42B."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"
