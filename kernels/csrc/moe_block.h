// A sparse Mixture-of-Experts block on one rank, as a layer's MLP in the C++ decoder-layer
// stack (decode_stack.h): workers/models/moe.py's SparseMoeBlock with every expert held
// here (no tensor or expert parallelism), dense experts, kernels/moe.py's fused_moe.
//
// Why: a MoE decode step was dominated by Python and the dispatch of small ops, not by the
// expert matmuls: the eager block issues ~25 ATen ops and a host loop per layer for the
// routing and the grouping (bench/profile_step.py --top). Here the grouping is loops over
// the few (token, slot) pairs, and the arithmetic is the very ATen calls the eager block
// makes, in its order, so the two agree to the bit:
//
//   router_logits = linear(x, gate)                         [N, E]
//   probs         = softmax(router_logits, -1, float32)     (ATen's exp: not ours)
//   weights, ids  = topk(probs, k); weights /= sum(weights)  (norm_topk_prob / Mixtral)
//   pairs grouped by expert, stable (tokens ascending); per *active* expert e, its rows
//   y_e  = down_e(silu(g) * u), [g | u] = gate_up_e(x_e)   (kernels/activation.py's SiLU;
//   the two multiplies dense mm over w13[e] / w2[e], or from some rows on oneDNN over
//   their packed forms, or up to a few rows matvec.h's expert_matvec over w13[e] / w2[e],
//   as kernels/moe.py's PackedExperts chooses)
//   out  = sum over each token's k slots, in slot order, of float32(y) * weight (float32)
//   (+ Qwen2-MoE's shared expert: sigmoid(linear(x, shared_gate)) * down(silu_and_mul(
//    gate_up(x))), its linears and SiLU those of the dense MLP)
//
// The block also counts each routed pair into ``expert_tokens`` (the buffer the worker
// reports expert load from), as count_expert_tokens does.
//
// Layouts: x [N, H] contiguous; gate [E, H]; expert e's gate_up: H -> 2I (gate rows over
// up rows), its down: I -> H; expert_tokens [E] int64.
#pragma once

#include <torch/extension.h>

#include <ATen/record_function.h>

#include <cstring>
#include <optional>
#include <vector>

#include "activation.h"
#include "linear.h"
#include "matvec.h"

namespace baton {

struct MoeBlock {
  // gate_up[e] / down[e]: expert e's two multiplies as the reference fused_moe makes them
  // (at::linear over w13[e] / w2[e]: its mm). packed_*: the same over kernels/moe.py's
  // PackedExperts (oneDNN), used, as its mlp uses them, for an expert's rows from
  // packed_min_rows on (none: always the dense ones).
  MoeBlock(at::Tensor gate, std::vector<Linear> gate_up, std::vector<Linear> down,
           std::vector<Linear> packed_gate_up, std::vector<Linear> packed_down,
           int64_t packed_min_rows, int64_t top_k, bool renormalize, at::Tensor expert_tokens,
           std::optional<Linear> shared_gate_up, std::optional<Linear> shared_down,
           std::optional<at::Tensor> shared_gate)
      : gate(std::move(gate)), gate_up(std::move(gate_up)), down(std::move(down)),
        packed_gate_up(std::move(packed_gate_up)), packed_down(std::move(packed_down)),
        packed_min_rows(packed_min_rows), top_k(top_k),
        renormalize(renormalize), expert_tokens(std::move(expert_tokens)),
        shared_gate_up(std::move(shared_gate_up)), shared_down(std::move(shared_down)),
        shared_gate(std::move(shared_gate)) {
    const int64_t e = static_cast<int64_t>(this->gate_up.size());
    TORCH_CHECK(e > 0 && static_cast<int64_t>(this->down.size()) == e,
                "MoeBlock: one gate_up and one down per expert");
    TORCH_CHECK(this->packed_gate_up.size() == this->packed_down.size() &&
                    (this->packed_gate_up.empty() ||
                     static_cast<int64_t>(this->packed_gate_up.size()) == e),
                "MoeBlock: packed experts: one gate_up and one down per expert, or none");
    TORCH_CHECK(this->gate.dim() == 2 && this->gate.size(0) == e,
                "MoeBlock: the router must be [E, H] over the E experts held");
    TORCH_CHECK(top_k >= 1 && top_k <= e, "MoeBlock: top_k must be in 1..", e);
    TORCH_CHECK(this->expert_tokens.scalar_type() == at::kLong &&
                    this->expert_tokens.is_contiguous() && this->expert_tokens.numel() == e,
                "MoeBlock: expert_tokens must be a contiguous int64 [E]");
    TORCH_CHECK(this->shared_gate_up.has_value() == this->shared_down.has_value() &&
                    this->shared_down.has_value() == this->shared_gate.has_value(),
                "MoeBlock: a shared expert needs its gate_up, down and gate");
  }

  // x [N, H] -> [N, H] in x's dtype; adds the step's pairs to expert_tokens.
  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t n = x.size(0), h = x.size(1), k = top_k, num_pairs = n * k;
    const int64_t num_experts = static_cast<int64_t>(gate_up.size());
    at::Tensor weights, ids;
    {
      RECORD_FUNCTION("baton::moe_route", std::vector<c10::IValue>());  // for the profiler
      at::Tensor probs = at::softmax(at::linear(x, gate), -1, at::kFloat);  // [N, E]
      std::tie(weights, ids) = at::topk(probs, k, -1);
      if (renormalize) weights = weights / weights.sum(-1, true);
      weights = weights.contiguous();
      ids = ids.contiguous();
    }
    const int64_t* id = ids.data_ptr<int64_t>();
    const float* weight = weights.data_ptr<float>();
    // Group the pairs by expert, stable: order[] lists pair ids, expert by expert.
    std::vector<int64_t> starts(num_experts + 1, 0), order(num_pairs);
    int64_t* load = expert_tokens.data_ptr<int64_t>();
    for (int64_t p = 0; p < num_pairs; ++p) {
      ++starts[id[p] + 1];
      ++load[id[p]];
    }
    for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
    {
      std::vector<int64_t> cursor(starts.begin(), starts.end() - 1);
      for (int64_t p = 0; p < num_pairs; ++p) order[cursor[id[p]]++] = p;
    }
    // Each pair's token row, grouped (the eager block's hidden[order // k]).
    at::Tensor input = x.contiguous();
    at::Tensor rows = at::empty({num_pairs, h}, x.options());
    const int64_t row_bytes = h * x.element_size();
    auto* src = static_cast<const char*>(input.data_ptr());
    auto* dst = static_cast<char*>(rows.data_ptr());
    for (int64_t i = 0; i < num_pairs; ++i)
      std::memcpy(dst + i * row_bytes, src + (order[i] / k) * row_bytes, row_bytes);
    // [N * k, H] float32: pair p's weighted expert output at row p (token p / k, slot p % k).
    at::Tensor pairs = at::empty({num_pairs, h}, x.options().dtype(at::kFloat));
    float* pair_out = pairs.data_ptr<float>();
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t begin = starts[e], count = starts[e + 1] - begin;
      if (count == 0) continue;
      at::Tensor y;  // [count, H]
      if (count <= matvec_max_rows) {  // matvec.h over the dense weights, as PackedExperts
        at::Tensor gu = expert_matvec(rows.narrow(0, begin, count), gate_up[e].weight);
        const int64_t inter = gu.size(1) / 2;
        at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
        y = expert_matvec(act, down[e].weight);
      } else {
        const bool packed = !packed_gate_up.empty() && count >= packed_min_rows;
        const Linear& first = packed ? packed_gate_up[e] : gate_up[e];
        const Linear& second = packed ? packed_down[e] : down[e];
        at::Tensor gu = first(rows.narrow(0, begin, count));  // [count, 2I]
        const int64_t inter = gu.size(1) / 2;
        at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
        y = second(act).contiguous();
      }
      AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, y.scalar_type(), "moe_block", [&] {
        const scalar_t* yp = y.data_ptr<scalar_t>();
        for (int64_t r = 0; r < count; ++r) {
          const int64_t p = order[begin + r];
          const float w = weight[p];
          float* out = pair_out + p * h;
          for (int64_t c = 0; c < h; ++c) out[c] = static_cast<float>(yp[r * h + c]) * w;
        }
      });
    }
    // Each token's k slots summed as the eager block sums them (ATen's sum over dim 1).
    at::Tensor out = pairs.view({n, k, h}).sum(1).to(x.scalar_type());
    if (shared_gate.has_value()) {
      at::Tensor scale = at::sigmoid(at::linear(input, *shared_gate));  // [N, 1]
      out = out + scale * (*shared_down)(silu_and_mul((*shared_gate_up)(input)));
    }
    return out;
  }

  at::Tensor gate;
  std::vector<Linear> gate_up, down, packed_gate_up, packed_down;
  int64_t packed_min_rows;
  // An expert's rows up to this many go through expert_matvec (matvec.h) over the dense
  // float32 weights instead (0: never), as PackedExperts.matvec_max_rows says.
  int64_t matvec_max_rows = 0;
  int64_t top_k;
  bool renormalize;
  at::Tensor expert_tokens;  // mutated: the pairs routed to each expert
  std::optional<Linear> shared_gate_up, shared_down;
  std::optional<at::Tensor> shared_gate;  // [1, H]
};

}  // namespace baton
