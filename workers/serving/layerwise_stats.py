"""A prefill worker's measured numbers for the layer-wise hand-off, and its choice.

``kvtransfer/layerwise.py`` chooses the layer-group size of one request from what its
hand-off costs; this keeps the inputs, measured here:

- **compute**: seconds per token and layer, from this engine's own steps with enough
  prefill tokens (``StepTimes.listeners``: the step's execute time over its tokens and
  the model's layers), as a moving average;
- **link**: (bytes, seconds) of past transfers: a whole-request hand-off's lease (from
  the handle event to the reader's "done": an upper bound of its transfer, the router
  hop and the reader's admission included) and a stream's last write (from its post to
  the stream's end). A line through them gives the bandwidth (slope) and the fixed cost
  of one transfer (intercept). Overestimating the fixed cost only makes the chooser
  keep fewer, larger groups or the whole request: the safe side.

Numbers missing (no prefill step, fewer than two transfer sizes): no layer-wise hand-off.
``kv_transfer.layerwise: on`` (``forced_min_tokens``) asks no number for the choice:
every prompt of at least that many tokens streams, in the plan's groups when it predicts
a gain, else one layer per write (a test or a benchmark then streams for sure).
The router learns the shortest prompt that would go layer-wise from each report
(``layerwise_min_tokens``) and reserves decode blocks first for those; the request's
group size is chosen here again when it arrives (one group per chunk if the numbers
moved and no longer predict a gain: the decode worker reserved already).
"""

from __future__ import annotations

import time
from collections import deque

from kvtransfer.layerwise import LayerwiseCost, LayerwisePlan, choose_layer_groups, chunk_costs

MIN_STEP_TOKENS = 16  # steps with fewer tokens are dominated by fixed costs
ALPHA = 0.2  # weight of the newest step in the compute average
MAX_SAMPLES = 64
THRESHOLD_EVERY_S = 2.0  # how often the reported threshold is recomputed
# Group sizes tried (those below the model's layer count): the prediction is flat near
# its optimum, and the report's threshold takes some hundred predictions on the loop.
CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)


class LayerwiseStats:
    def __init__(
        self,
        num_layers: int,
        block_size: int,
        block_layer_bytes: int,
        chunk_tokens: int,
        max_prompt_tokens: int,
        min_gain: float = 0.05,
        forced_min_tokens: int = 0,
    ):
        """``forced_min_tokens`` > 0: ``kv_transfer.layerwise: on`` with that threshold."""
        self.num_layers = num_layers
        self.block_size = block_size
        self.block_layer_bytes = block_layer_bytes  # KV bytes of one layer of one block
        self.chunk_tokens = chunk_tokens  # the engine's token budget per step
        self.max_prompt_tokens = max_prompt_tokens
        self.min_gain = min_gain
        self.forced_min_tokens = forced_min_tokens
        self.layer_s_per_token: float | None = None
        self._links: deque[tuple[int, float]] = deque(maxlen=MAX_SAMPLES)
        self._min_tokens = 0
        self._computed_at = -THRESHOLD_EVERY_S
        self._changed = True

    # ---- measurements ------------------------------------------------------------------
    def observe_step(self, batch: int, num_tokens: int, seconds: tuple[float, ...]) -> None:
        """One engine step (``StepTimes.listeners``): ``seconds[2]`` is its execute time."""
        if num_tokens - batch < MIN_STEP_TOKENS:
            return  # (nearly) a decode step
        sample = seconds[2] / (num_tokens * self.num_layers)
        old = self.layer_s_per_token
        self.layer_s_per_token = sample if old is None else (1 - ALPHA) * old + ALPHA * sample
        self._changed = True

    def observe_link(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self._links.append((num_bytes, seconds))
            self._changed = True

    def link(self) -> tuple[float, float] | None:
        """(bandwidth bytes/s, per-transfer seconds) from the samples; None: unknown."""
        if len({b for b, _ in self._links}) < 2:
            return None
        n = len(self._links)
        mean_b = sum(b for b, _ in self._links) / n
        mean_s = sum(s for _, s in self._links) / n
        var = sum((b - mean_b) ** 2 for b, _ in self._links)
        slope = sum((b - mean_b) * (s - mean_s) for b, s in self._links) / var
        if slope <= 0:
            return None
        return 1.0 / slope, max(mean_s - slope * mean_b, 0.0)

    # ---- the choice --------------------------------------------------------------------
    def plan(self, num_tokens: int) -> LayerwisePlan | None:
        """The chooser's plan for a prompt of ``num_tokens`` computed here; None when a
        number is missing."""
        link = self.link()
        if self.layer_s_per_token is None or link is None or num_tokens < 1:
            return None
        full, rest = divmod(num_tokens, self.chunk_tokens)
        chunks = (self.chunk_tokens,) * full + ((rest,) if rest else ())
        layer_s, layer_bytes = chunk_costs(
            chunks, self.block_size, self.layer_s_per_token, self.block_layer_bytes
        )
        cost = LayerwiseCost(self.num_layers, layer_s, layer_bytes, link[0], link[1])
        sizes = tuple(c for c in CANDIDATES if c < self.num_layers) or (1,)
        return choose_layer_groups(cost, min_gain=self.min_gain, candidates=sizes)

    def group_size(self, num_tokens: int) -> int:
        """Layers per write for a request the router sent with a reservation: the plan's,
        or every layer at once (one write per chunk) when it no longer predicts a gain."""
        plan = self.plan(num_tokens)
        if plan is None or plan.group_size is None:
            # Forced (layerwise: on): layer-wise all the same, one layer per write.
            return 1 if self.forced_min_tokens else self.num_layers
        return plan.group_size

    def min_tokens(self) -> int:
        """The shortest prompt the plan streams layer-wise (0: none), for the report;
        recomputed at most every ``THRESHOLD_EVERY_S`` when a number changed; forced:
        the configured one."""
        if self.forced_min_tokens:
            return min(self.forced_min_tokens, self.max_prompt_tokens)
        now = time.monotonic()
        if not self._changed or now - self._computed_at < THRESHOLD_EVERY_S:
            return self._min_tokens
        self._computed_at, self._changed = now, False
        self._min_tokens = self._threshold()
        return self._min_tokens

    def _threshold(self) -> int:
        def streams(n: int) -> bool:
            plan = self.plan(n)
            return plan is not None and plan.group_size is not None

        def first(lo: int, hi: int) -> int:
            """The shortest in [lo, hi] that streams, ``hi`` doing so: within one chunk
            count the gain grows with the prompt (more compute to hide under)."""
            while lo < hi:
                mid = (lo + hi) // 2
                if streams(mid):
                    hi = mid
                else:
                    lo = mid + 1
            return lo

        top = self.max_prompt_tokens
        n = min(self.block_size, top)  # doubling from short prompts: cheap predictions
        while n >= 1 and not streams(n):
            if n >= top:
                return 0
            n = min(2 * n, top)
        if n < 1:
            return 0
        lo = first(max(n // 2, 1), n)
        # A short last chunk adds transfers for little compute: the gain dips just past
        # each chunk boundary, less so the longer the prompt. Past the first that keeps
        # streaming, the later ones do too.
        for dip in range(self.chunk_tokens + 1, top + 1, self.chunk_tokens):
            if dip <= lo:
                continue
            if streams(dip):
                break
            end = min(dip + self.chunk_tokens - 1, top)
            if not streams(end):
                lo = end + 1  # this whole chunk's range loses: on to the next
                continue
            lo = first(dip + 1, end)
        return lo if lo <= top else 0
