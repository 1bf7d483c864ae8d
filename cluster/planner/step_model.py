"""What a step costs: online least-squares fits of a worker's step time from its step records.

The planner (``cluster/planner/policy.py``) predicts latency for pool sizes it has not run,
so it needs each pool's step time as a function of the work in the step, not a mean:

- prefill: ``seconds = a + b * tokens + c * attention_work + d * overlap`` where ``tokens``
  are the step's prompt tokens computed and ``attention_work`` is the sum over its chunks
  of ``chunk_len * context_len / 1000`` (the quadratic part of a long prompt);
- decode: ``seconds = a + b * batch + c * kv_tokens / 1000 + d * overlap`` (weights read
  once per step, plus each sequence's KV read);
- ``overlap`` is the share of the step during which the other pool computed: pools that
  share cores slow each other down (``cluster/planner/busy.py`` has the measurement); on
  separate accelerators ``d`` fits to ~0. The simulation uses ``max(d, 0)``.

``OnlineFit`` keeps the normal equations of a least-squares fit with exponential forgetting
(a factor per record), so the fit follows a model or machine change without a window of
records, and costs O(features^2) per record. A new worker's first ``warmup_steps`` records
are left out (``StepModel.observe``): cold caches, compilation and the first allocations
make them slow, and counting them over-scales the pool (Dynamo #12430).

**The spread** (``spread_records`` > 0): a fit gives a step's *mean* time, but a p90 is
set by the slow steps: on a shared CPU a decode step's time varies by 2x with the same
batch (another thread's step, the OS), and the validation against real engines
(``bench/planner_validate.py``) measured p90 ITL 1.3-2x the fitted mean at light load.
So the fit also keeps its last records and offers their ratios to the fit
(``spread()``, sorted), which the simulation multiplies its steps by in a fixed
low-discrepancy order: the replay keeps the steps' measured distribution and stays
deterministic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class OnlineFit:
    """Least squares ``y ~ x . coef`` over records weighted by ``forgetting ** age``."""

    num_features: int
    forgetting: float = 0.999
    ridge: float = 1e-9  # keeps the system solvable before every feature has varied
    spread_records: int = 0  # the last records kept for ``spread`` (0: none)
    _xtx: list[list[float]] = field(init=False)
    _xty: list[float] = field(init=False)
    num_records: int = field(init=False, default=0)
    # The solve is cached until the next record: a simulation asks for a step's cost
    # hundreds of thousands of times between two records.
    _coefficients: tuple[float, ...] | None = field(init=False, default=None)
    _recent: deque[tuple[tuple[float, ...], float]] = field(init=False)
    _spread: tuple[float, ...] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        n = self.num_features
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._recent = deque(maxlen=self.spread_records)

    def add(self, x: tuple[float, ...], y: float) -> None:
        if len(x) != self.num_features:
            raise ValueError(f"{len(x)} features, the fit has {self.num_features}")
        f = self.forgetting
        for i in range(self.num_features):
            self._xty[i] = f * self._xty[i] + x[i] * y
            row = self._xtx[i]
            for j in range(self.num_features):
                row[j] = f * row[j] + x[i] * x[j]
        self.num_records += 1
        self._coefficients = None
        if self.spread_records:
            self._recent.append((x, y))
            self._spread = None

    def spread(self) -> tuple[float, ...]:
        """The recent records' ratios measured / fitted, sorted ((): none kept); each
        ratio bounded to [0.25, 4] so one stalled step does not stand for many."""
        if self._spread is None:
            coef = self.coefficients()
            ratios = []
            for x, y in self._recent:
                fitted = sum(c * v for c, v in zip(coef, x, strict=True))
                if fitted > 0:
                    ratios.append(min(4.0, max(0.25, y / fitted)))
            self._spread = tuple(sorted(ratios))
        return self._spread

    def coefficients(self) -> tuple[float, ...]:
        """The fitted coefficients (Gaussian elimination with partial pivoting)."""
        if self._coefficients is None:
            self._coefficients = self._solve()
        return self._coefficients

    def _solve(self) -> tuple[float, ...]:
        n = self.num_features
        a = [[*row, self._xty[i]] for i, row in enumerate(self._xtx)]
        for i in range(n):
            a[i][i] += self.ridge * (1.0 + a[i][i])
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            a[col], a[pivot] = a[pivot], a[col]
            if a[col][col] == 0.0:
                continue
            for r in range(n):
                if r != col and a[r][col]:
                    factor = a[r][col] / a[col][col]
                    a[r] = [vr - factor * vc for vr, vc in zip(a[r], a[col], strict=True)]
        return tuple(a[i][n] / a[i][i] if a[i][i] else 0.0 for i in range(n))


@dataclass(frozen=True)
class PrefillStep:
    """One prefill step as a worker reports it."""

    worker_id: str
    seconds: float
    tokens: int  # prompt tokens computed in the step
    attention_work: float  # sum over its chunks of chunk_len * context_len / 1000
    end_s: float = field(default=0.0, compare=False)  # when it ended (feed's clock; 0: unknown)
    overlap: float = field(default=0.0, compare=False)  # share of it the other pool computed


@dataclass(frozen=True)
class DecodeStep:
    """One decode step as a worker reports it."""

    worker_id: str
    seconds: float
    batch: int  # sequences that got a token
    kv_tokens: int  # their context lengths, summed
    end_s: float = field(default=0.0, compare=False)  # when it ended (feed's clock; 0: unknown)
    overlap: float = field(default=0.0, compare=False)  # share of it the other pool computed


INTERFERENCE_S = 1e-4  # 0.1 ms a step: below it the pools count as independent


class StepModel:
    """Fits of both pools' step times, fed with the workers' step records."""

    def __init__(
        self, warmup_steps: int = 20, forgetting: float = 0.999, spread_records: int = 0
    ) -> None:
        self.warmup_steps = warmup_steps
        self.prefill = OnlineFit(4, forgetting, spread_records=spread_records)
        self.decode = OnlineFit(4, forgetting, spread_records=spread_records)
        self._seen: dict[str, int] = {}

    def _past_warmup(self, worker_id: str) -> bool:
        count = self._seen.get(worker_id, 0) + 1
        self._seen[worker_id] = count
        return count > self.warmup_steps

    def observe(self, step: PrefillStep | DecodeStep) -> bool:
        """Add a step record; False when it was left out (the worker's warm-up)."""
        if not self._past_warmup(step.worker_id):
            return False
        self._add(step)
        return True

    def seed(self, steps: Iterable[PrefillStep | DecodeStep]) -> int:
        """Add measured records that are no worker's warm-up (``baton profile``'s, taken
        after its own warm-up): the fits can plan before the first worker has served.
        Online records then outweigh them as they come (the fits' forgetting). Returns
        how many were added."""
        count = 0
        for step in steps:
            self._add(step)
            count += 1
        return count

    def _add(self, step: PrefillStep | DecodeStep) -> None:
        if isinstance(step, PrefillStep):
            x = (1.0, float(step.tokens), step.attention_work, step.overlap)
            self.prefill.add(x, step.seconds)
        else:
            x = (1.0, float(step.batch), step.kv_tokens / 1000.0, step.overlap)
            self.decode.add(x, step.seconds)

    def forget_worker(self, worker_id: str) -> None:
        """A worker left the pool: a new one under the same id warms up again."""
        self._seen.pop(worker_id, None)

    @property
    def is_ready(self) -> bool:
        """Both pools have enough records for a fit worth planning on."""
        return self.prefill.num_records >= 8 and self.decode.num_records >= 8

    @property
    def has_interference(self) -> bool:
        """Either pool's steps fit slower while the other computes (shared cores), by more
        than ``INTERFERENCE_S`` (a fit of independent pools leaves a rounding-sized term)."""
        d_prefill, d_decode = self.prefill.coefficients()[3], self.decode.coefficients()[3]
        return max(d_prefill, d_decode) > INTERFERENCE_S

    def prefill_seconds(self, tokens: int, attention_work: float, overlap: float = 0.0) -> float:
        """A prefill step's fitted time; ``overlap``: the share of it decode computes."""
        a, b, c, d = self.prefill.coefficients()
        return max(a + b * tokens + c * attention_work + max(d, 0.0) * overlap, 1e-6)

    def decode_seconds(self, batch: int, kv_tokens: int, overlap: float = 0.0) -> float:
        """A decode step's fitted time; ``overlap``: the share of it prefill computes."""
        a, b, c, d = self.decode.coefficients()
        return max(a + b * batch + c * kv_tokens / 1000.0 + max(d, 0.0) * overlap, 1e-6)
