"""Admission: how a waiting request gets its blocks and its computed count.

The scheduler picks *which* waiting request is admitted (FCFS, within the token budget
and ``max_num_seqs``) and moves it between its queues; this module decides what the
request starts with. Its prompt's leading blocks that the pool's prefix cache holds are
shared (they count as computed); with **KV tiers** (docs/kv-tiers.md) the hit continues
through the tiers below the pool (host memory, disk), and the blocks found there are
onboarded into fresh blocks before the request's first chunk, or layer-wise while it
computes (``kv_tiers/layer_onboard.py``): they count as computed too, like a prefix hit.
Fewer may arrive than were found (an unreadable block): the request computes from the
first missing one. A request that still needs its prompt logprobs
(``Request.needs_prompt_logprobs``) takes no hit at all: every prompt position's logits
are computed (vLLM skips the prefix cache for such requests too).

Two paths, the same rules:

- ``allocate``: any request computed here (either role): blocks for its computed prefix
  and its first chunk.
- ``allocate_receiving`` (decode role): a remote prefill, or a peer pull (G4), whose
  first ``num_remote_tokens`` come from another worker: the prefix it holds is shared or
  onboarded, fresh blocks take the rest of the remote part, and only those are received.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import TYPE_CHECKING

from workers.engine.block_manager import BlockManager, PrefixHit
from workers.engine.handoff import KVHandoff
from workers.engine.request import Request

if TYPE_CHECKING:
    from workers.engine.kv_tiers.manager import KVTierManager, TierHit


class NotAdmitted(Enum):
    """Why ``Admission`` admitted no request (it changed nothing in the pool)."""

    NO_BLOCKS = "no_blocks"  # too few free blocks: the request waits at the head of the queue
    # Its prefix is being onboarded layer-wise for a request admitted in this step: it
    # shares those blocks from the pool next step instead of reading them again.
    NEXT_STEP = "next_step"
    DECLINED = "declined"  # a peer prefix this worker already holds: admit it as any other


class Admission:
    """Allocates a waiting request's blocks (sharing and onboarding its cached prefix) and
    says how many of its tokens are computed. Moves no request between queues: the
    scheduler (``workers/engine/scheduler.py``) does that with the count returned."""

    def __init__(
        self,
        block_manager: BlockManager,
        handoff: KVHandoff,
        tiers: KVTierManager | None = None,
    ):
        """``tiers``: the KV tiers below the pool, which prefix blocks are onboarded from
        (None: off)."""
        self.block_manager = block_manager
        self.handoff = handoff
        self.tiers = tiers

    def allocate(self, req: Request, budget: int) -> int | NotAdmitted:
        """Blocks for ``req``'s cached prefix (shared from the pool, onboarded from the
        tiers) and its first chunk of up to ``budget`` tokens; returns the tokens now
        computed (the chunk starts there), or NO_BLOCKS / NEXT_STEP (nothing allocated)."""
        bm = self.block_manager
        if req.needs_prompt_logprobs:  # every prompt position's logits are needed (as vLLM)
            prefix, hit = PrefixHit((), ()), None
        else:
            prefix = bm.find_prefix(req.token_ids, req.cache_root)
            hit = self.tiers.find(req.token_ids, prefix, req.cache_root) if self.tiers else None
            if hit is not None and hit.num_blocks and self.tiers.layerwise.is_onboarding(hit):
                return NotAdmitted.NEXT_STEP  # (its blocks enter the pool when the step ends)
        num_cached = (prefix.num_blocks + (hit.num_blocks if hit else 0)) * bm.block_size
        num_new = min(req.num_tokens - num_cached, budget)
        if not bm.allocate_slots(req.request_id, num_cached, num_new, prefix):
            return NotAdmitted.NO_BLOCKS
        if hit is not None and hit.num_blocks:
            # Fewer blocks may arrive than found: the caller computes from the first missing
            # one. The blocks allocated cover it: num_cached only goes down, and the chunk's
            # end (num_cached + its budget-capped length) with it.
            assert self.tiers is not None
            if self.tiers.layerwise.applies(hit):
                # Onboarded while this step's chunk computes; what fails to arrive is rolled
                # back by that step (``LayerOnboarder.settle``), the same rule applied later.
                num_cached = self.tiers.start_onboard(req.request_id, prefix, hit)
                req.num_onboarded_tokens = hit.num_blocks * bm.block_size
            else:
                num_cached = self._onboard(req, prefix, hit)
        return num_cached

    def allocate_receiving(self, req: Request) -> int | NotAdmitted:
        """Decode role: blocks for a request whose first ``num_remote_tokens`` come from
        another worker: a remote prefill (its whole prompt's KV comes from P) or a peer
        pull (the rest is computed here after). Returns the tokens computed before the
        receive (its first block starts there), NO_BLOCKS, or DECLINED.

        The prompt's leading blocks that this worker's prefix cache holds are shared (they
        count as computed), those the tiers below it hold are onboarded into fresh blocks;
        fresh blocks take the rest of the remote part, and only those are received. The
        transfer never writes a shared block (it would be overwritten under its other
        owners). A remote prefill receives at least its last prompt block (``find_prefix``
        leaves one token), so there is always one transfer, whose notice frees P's lease. A
        peer prefix this cache already covers is not received at all: its handles are
        declined (``KVHandoff.not_needed``) and DECLINED says to admit the request as any
        other. The first output token's slot is allocated by its first decode step.
        """
        bm = self.block_manager
        prompt = req.prompt_token_ids
        prefix = bm.find_prefix(prompt, req.cache_root)
        # The tiers below the pool too: their blocks are onboarded, not received.
        hit = self.tiers.find(prompt, prefix, req.cache_root) if self.tiers else None
        num_cached = (prefix.num_blocks + (hit.num_blocks if hit else 0)) * bm.block_size
        num_remote = req.num_remote_tokens
        if num_cached >= num_remote:  # a peer prefix only: a remote prefill never gets here
            self.handoff.not_needed(req.request_id)
            req.num_peer_tokens = 0
            return NotAdmitted.DECLINED
        if not bm.allocate_slots(req.request_id, num_cached, num_remote - num_cached, prefix):
            return NotAdmitted.NO_BLOCKS
        if hit is not None and hit.num_blocks:
            # Synchronous: a receiving request runs no step that could wait per layer (its
            # blocks wait for the transfer, which takes longer anyway).
            num_cached = self._onboard(req, prefix, hit)  # fewer may arrive: receive those
        return num_cached

    def _onboard(self, req: Request, prefix: PrefixHit, hit: TierHit) -> int:
        """Onboard the tiers' blocks of ``req``'s prefix into its fresh blocks after
        ``prefix`` (``KVTierManager.onboard_request``); returns the tokens now computed."""
        assert self.tiers is not None
        start_ns = time.time_ns()
        num_cached = self.tiers.onboard_request(
            req.request_id, req.token_ids, prefix, hit, req.cache_root
        )
        req.onboard_ns = (start_ns, time.time_ns())
        req.num_onboarded_tokens = num_cached - prefix.num_blocks * self.block_manager.block_size
        return num_cached
