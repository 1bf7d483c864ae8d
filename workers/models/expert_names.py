"""How a MoE architecture's checkpoints name its experts, mapped onto Baton's stacked
parameters (``mlp.experts.w13`` / ``w2`` of ``workers/models/moe.py``, ``mlp.gate.weight``).

Checkpoint layouts (``ExpertNames`` maps both onto ``w13`` / ``w2``):
- per expert, as on the Hub and as transformers' ``save_pretrained`` writes them:
  ``{block}.experts.{e}.{gate|up|down}.weight``, [I, H] / [I, H] / [H, I] (Mixtral:
  block ``block_sparse_moe``, w1 / w3 / w2; Qwen: block ``mlp``, gate_proj / up_proj /
  down_proj), and the router ``{block}.gate.weight``;
- stacked, as transformers 5 holds them in memory (``save_original_format=False``):
  ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows over up rows) and
  ``mlp.experts.down_proj`` [E, H, I], the router ``mlp.gate.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A shard_id of FusedExperts.weight_loader: (piece, global expert id); expert None: the
# stacked tensor of every expert ("gate_up" [E, 2I, H], "down" [E, H, I]).
ExpertShard = tuple[str, int | None]


@dataclass(frozen=True)
class ExpertNames:
    """How an architecture's checkpoints name the MoE block's tensors (module docstring),
    and their mapping onto this model's parameters (``mlp.gate.weight``,
    ``mlp.experts.w13`` / ``w2``). Missing tensors are reported by their per-expert names,
    whichever layout the checkpoint has."""

    block: str  # "block_sparse_moe" (Mixtral) or "mlp"
    gate: str  # an expert's gate projection: "w1" / "gate_proj"
    up: str  # "w3" / "up_proj"
    down: str  # "w2" / "down_proj"
    num_experts: int

    def to_param(self, name: str) -> tuple[str, ExpertShard | None, tuple[str, ...]] | None:
        """Checkpoint tensor ``name`` -> (parameter name, shard_id, the per-expert names it
        covers), or None when it is no expert or router tensor."""
        block, num = re.escape(self.block), self.num_experts
        if m := re.fullmatch(rf"(.*)\.(?:{block}|mlp)\.gate\.weight", name):
            return f"{m[1]}.mlp.gate.weight", None, (f"{m[1]}.{self.block}.gate.weight",)
        pieces = {self.gate: "gate", self.up: "up", self.down: "down"}
        names = "|".join(map(re.escape, pieces))
        if m := re.fullmatch(rf"(.*)\.{block}\.experts\.(\d+)\.({names})\.weight", name):
            param = "w2" if pieces[m[3]] == "down" else "w13"
            return f"{m[1]}.mlp.experts.{param}", (pieces[m[3]], int(m[2])), (name,)
        if m := re.fullmatch(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)", name):
            prefix, kinds = m[1], (self.gate, self.up) if m[2] == "gate_up_proj" else (self.down,)
            covered = tuple(self.expert_name(prefix, e, k) for e in range(num) for k in kinds)
            if m[2] == "gate_up_proj":
                return f"{prefix}.mlp.experts.w13", ("gate_up", None), covered
            return f"{prefix}.mlp.experts.w2", ("down", None), covered
        return None

    def expected(self, names: set[str]) -> set[str]:
        """The checkpoint names that fill parameters ``names``: a router and the stacked
        experts by their per-expert names, every other name as it is."""
        out = set()
        for name in names:
            if m := re.fullmatch(r"(.*)\.mlp\.gate\.weight", name):
                out.add(f"{m[1]}.{self.block}.gate.weight")
            elif m := re.fullmatch(r"(.*)\.mlp\.experts\.(w13|w2)", name):
                kinds = (self.gate, self.up) if m[2] == "w13" else (self.down,)
                out.update(
                    self.expert_name(m[1], e, k) for e in range(self.num_experts) for k in kinds
                )
            else:
                out.add(name)
        return out

    def expert_name(self, prefix: str, expert: int, kind: str) -> str:
        return f"{prefix}.{self.block}.experts.{expert}.{kind}.weight"
