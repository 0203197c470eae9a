"""When a draft pays: a step-cost model from measured step times and per-row acceptance rates.

A decode step of R rows verifying D draft ids costs about `a + r*R + d*D` seconds, plus `c`
when it verifies any (logits at every drafted position, the drafted rows' own attention
groups, the general forward instead of the plain decode step). `StepCosts` fits (a, r, d, c)
by least squares with forgetting over the decode-only steps the scheduler measures (forward +
commit; a prompt chunk's positions cost less each and would skew the line), so the model
follows the hardware and the load. A row and a draft id are not the same cost: a row is one
more sequence (its own attention over its context, its sampling), a draft id one more query
position of a row already there; on 2 CPU cores (SmolLM2, 4 rows, benchmark/draft_cost.py)
a plain step took 51-53 ms, one row verifying 1 id 70 ms and 8 ids 80-98 ms, i.e. c ~ 12-20 ms
and d ~ 1.3-4 ms, where a single slope over all positions had fitted ~5 ms a position and c ~
5 ms, so one- and two-id drafts passed where they cost more than they made (issue 38). The
(d, c) fit runs over drafted steps only, on what they cost beyond the plain fit, and fades per
drafted step: while nothing drafts it keeps what drafting cost.

The rule (`StepCosts.lengths`): plain decoding of R rows makes R tokens per `a + r*R` seconds.
A row's j-th draft id is kept with probability alpha^j (alpha: the acceptance rate of the
draft's source, e.g. a 3-token lookup match, scaled by how the row fared against that rate
lately, see `Acceptance`), so it is worth its position only if alpha^j beats what plain decoding
makes in the position's time: alpha^j > d * R / (a + r*R). Each row drafts the ids that pass;
the step drafts at all only if their expected tokens also pay for `c`. More rows decoding make
each position dearer relative to the tokens plain decoding makes, so drafting thins out as the
batch fills, and a row (or a source) whose drafts fail stops drafting until its record fades.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROW_MEMORY = 0.7  # weight of a row's earlier evidence at each verified draft
ROW_FADE = 0.98  # per step: a row's evidence fades, so its source's rate takes over again
PRIOR_TRIALS = 1.0  # positions' worth of the source's rate in a row's estimate
MAX_RATE = 0.99
SOURCE_MEMORY = 0.98  # weight of a source's earlier evidence at each verified draft
# per step: a source's evidence fades toward its start, so one that fell under the bar (and so
# stopped being tried) is tried again after a while: what it meets may have changed
SOURCE_FADE = 0.995
SOURCE_START = {"prediction": 0.8}  # a source's rate before any evidence (others: DEFAULT)
DEFAULT_START = 0.5
COST_MEMORY = 0.95  # weight of earlier plain steps in the (a, r) fit, per plain step
# weight of earlier drafted steps in the (d, c) fit, per DRAFTED step: the draft cost is kept
# while nothing drafts (fading it per step let c fall back to its prior after a few dozen plain
# steps, so drafting resumed at a cost it had already measured)
DRAFT_MEMORY = 0.9
PRIOR_R = 0.1  # r as a fraction of a before steps of several sizes
# d and c as fractions of a before drafted steps were measured (2 CPU cores, SmolLM2, 4 rows
# measured d 0.025a, c 0.4a, benchmark/draft_cost.py; c's prior is lower so that drafts are
# tried, and measured, where the sources' start rates promise enough)
PRIOR_D, PRIOR_C = 0.03, 0.1
PRIOR_STEPS = 0.25  # weight of that prior, in measured steps


@dataclass
class Acceptance:
    """A row's recent draft acceptance relative to its drafts' sources: kept ids over the ids
    the sources' rates expected over the positions tried (geometric: after the first rejected
    id nothing more is learned); the record fades, so the sources' rates take over again."""

    hits: float = 0.0
    expected: float = 0.0

    def note(self, drafted: int, accepted: int, source_rate: float) -> None:
        tried = accepted + (1 if accepted < drafted else 0)
        self.hits = ROW_MEMORY * self.hits + accepted
        self.expected = ROW_MEMORY * self.expected + tried * source_rate

    def tick(self) -> None:
        """One step passed."""
        self.hits *= ROW_FADE
        self.expected *= ROW_FADE

    def rate(self, source_rate: float) -> float:
        """The chance each id of a draft from a source with `source_rate` is kept."""
        factor = (self.hits + PRIOR_TRIALS) / (self.expected + PRIOR_TRIALS)
        return min(source_rate * factor, MAX_RATE)


class StepCosts:
    """The fitted step cost and the acceptance rate of each drafting source."""

    def __init__(self) -> None:
        self._s = np.zeros((2, 2))  # plain steps: weighted sum of x x^T, x = [1, rows]
        self._v = np.zeros(2)  # weighted sum of x * seconds
        self._ds = np.zeros((2, 2))  # drafted steps: x = [1, ids], y = seconds - (a + r*rows)
        self._dv = np.zeros(2)
        self._coef: tuple[float, float, float, float] | None = None
        self._sources: dict[str, list[float]] = {}  # source -> [hits, trials]

    def observe(self, rows: int, ids: int, seconds: float) -> None:
        """One measured decode step: `rows` decoding, `ids` draft ids verified with them."""
        if ids <= 0:
            x = np.array([1.0, float(rows)])
            self._s = COST_MEMORY * self._s + np.outer(x, x)
            self._v = COST_MEMORY * self._v + x * seconds
        else:
            plain = self._plain()
            if plain is None:
                return  # nothing to measure the extra against yet
            x = np.array([1.0, float(ids)])
            extra = seconds - (plain[0] + plain[1] * rows)
            self._ds = DRAFT_MEMORY * self._ds + np.outer(x, x)
            self._dv = DRAFT_MEMORY * self._dv + x * extra
        self._coef = None

    def _plain(self) -> tuple[float, float] | None:
        """(a, r): a plain decode step of R rows costs a + r*R; None before one was measured."""
        if self._s[0, 0] <= 0:
            return None
        n, mean_r = self._s[0, 0], self._s[0, 1] / self._s[0, 0]
        a0 = self._v[0] / n / (1.0 + PRIOR_R * mean_r)
        prior = np.array([a0, PRIOR_R * a0])
        # ridge toward the prior, a quarter step's worth on each coefficient (at its scale)
        weight = PRIOR_STEPS * np.diag([1e-6, max(mean_r, 1.0) ** 2])
        a, r = np.linalg.solve(self._s + weight, self._v + weight @ prior)
        a = max(a, 1e-6)
        return a, min(max(r, 1e-3 * a), a)

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a, r, d, c) in seconds; None before any plain step was measured."""
        if self._coef is None and (plain := self._plain()) is not None:
            a, r = plain
            mean_d = self._ds[0, 1] / self._ds[0, 0] if self._ds[0, 0] > 0 else 1.0
            prior = np.array([PRIOR_C * a, PRIOR_D * a])
            weight = PRIOR_STEPS * np.diag([1.0, max(mean_d, 1.0) ** 2])
            c, d = np.linalg.solve(self._ds + weight, self._dv + weight @ prior)
            self._coef = (a, r, min(max(d, 1e-3 * a), a), max(c, 0.0))
        return self._coef

    def note(self, source: str, drafted: int, accepted: int) -> None:
        """A verified draft from `source` (the rate new rows start from)."""
        hits, trials = self._sources.setdefault(source, [0.0, 0.0])
        tried = accepted + (1 if accepted < drafted else 0)
        self._sources[source] = [
            SOURCE_MEMORY * hits + accepted,
            SOURCE_MEMORY * trials + tried,
        ]

    def tick(self) -> None:
        """One step passed."""
        for record in self._sources.values():
            record[0] *= SOURCE_FADE
            record[1] *= SOURCE_FADE

    def source_rate(self, source: str) -> float:
        start = SOURCE_START.get(source, DEFAULT_START)
        hits, trials = self._sources.get(source, (0.0, 0.0))
        return (hits + 2.0 * start) / (trials + 2.0)

    def report(self) -> dict:
        """The fit and each source's rate, for benchmarks: {"fit_ms": {"a", "r", "d", "c"} or
        None, "sources": {source: rate}}."""
        coef = self.coefficients()
        fit = (
            None
            if coef is None
            else {k: round(x * 1000, 3) for k, x in zip("ardc", coef, strict=True)}
        )
        return {
            "fit_ms": fit,
            "sources": {s: round(self.source_rate(s), 3) for s in sorted(self._sources)},
        }

    def lengths(self, decoding: int, rows: dict[int, tuple[float, int]]) -> dict[int, int]:
        """Draft ids worth verifying per row. `decoding`: rows decoding this step; `rows`:
        row -> (its acceptance rate, ids it could draft)."""
        coef = self.coefficients()
        if coef is None:  # no plain step measured yet: nothing to weigh a draft against
            return {}
        a, r, d, c = coef
        per_second = decoding / (a + r * decoding)  # tokens plain decoding makes
        bar = d * per_second  # a draft id must be kept more often than this
        out: dict[int, int] = {}
        gain = 0.0
        for row, (alpha, most) in rows.items():
            n, p = 0, alpha
            while n < most and p > bar:
                gain += p
                n, p = n + 1, p * alpha
            if n:
                out[row] = n
        ids = sum(out.values())
        if gain <= (d * ids + c) * per_second:
            return {}
        return out
