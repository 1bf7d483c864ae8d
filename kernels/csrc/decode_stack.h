// A decode step's decoder layers in one C++ call, on CPU (workers/models/fused_decode.py).
//
// Why: on a real small model (SmolLM2-135M, 30 layers) about half of an eager decode step
// at one sequence was Python and the dispatch of ~75 small ATen ops per layer (norms,
// rotary, the KV store's indexing, views), not arithmetic (bench/profile_step.py). Here a
// layer is its four matmuls (the same calls the eager layers make: oneDNN over the packed
// weight, F.linear, or the int4 kernel) and loops for the rest (the norms and SiLU are the
// CPU op set's own, rms_norm.h and activation.h), so a step costs one call from Python.
//
// Scope: single-token decodes of a Llama-family layer (Llama, Mistral, Qwen2's q/k/v bias,
// Qwen3's per-head q/k norms), its MLP dense or a sparse MoE block (moe_block.h: Mixtral,
// Qwen2/Qwen3-MoE), on one rank, float32 or bfloat16, a KV cache of the model's
// dtype or packed FP8 rows (kernels/fp8_kv.py); the caller (Python) sends anything else
// through the eager layers.
//
// Numerics follow the eager ops (kernels/rms_norm.py, rotary.py, kv_store.py): each
// elementwise result is rounded to the model dtype where the eager op rounds it, norms
// accumulate in float32. Sums run in another order, so results agree to float rounding.
// An FP8 row is quantized as kernels/fp8_kv.py quantize_rows does it, to the bit.
//
// Layouts:
//   hidden        [N, hidden] (the embedded tokens; the result has the same shape)
//   positions     [N] int64
//   kv_cache      [num_blocks, num_layers, 2, Hkv, block_size, D] (the whole cache), or
//                 uint8 [..., D + 4] for FP8
//   slot_mapping  [N] int64 (negative: do not store), block_tables [N, max_blocks] int32,
//   seq_lens      [N] int32, as for paged_decode.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "activation.h"
#include "linear.h"
#include "moe_block.h"
#include "paged_decode.h"
#include "rms_norm.h"

namespace baton {

struct DecoderLayer {
  Linear qkv, o;
  // The MLP: a dense one (gate_up, down) or a sparse MoE block (moe_block.h).
  std::optional<Linear> gate_up, down;
  std::optional<MoeBlock> moe;
  at::Tensor input_norm, post_norm;       // [hidden]
  std::optional<at::Tensor> q_norm, k_norm;  // [head_dim] (Qwen3)
  int64_t cache_layer;                    // this layer's index in the KV cache
  // A checkpoint's static FP8 KV scales (workers/models/attention.py); NaN: each row's own.
  float k_scale, v_scale;
};

namespace decode_stack_detail {

// RoPE in place on `heads` heads of D features (neox halves, the first rot_dim rotated),
// each product and sum rounded to T as kernels/rotary.py's tensor ops round them.
template <typename T>
inline void rotate_heads(T* x, int64_t heads, int64_t head_dim, const T* cos_sin,
                         int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* v = x + hd * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float c = static_cast<float>(cos_sin[i]), s = static_cast<float>(cos_sin[half + i]);
      const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[half + i]);
      v[i] = static_cast<T>(rounded<T>(x1 * c) - rounded<T>(x2 * s));
      v[half + i] = static_cast<T>(rounded<T>(x2 * c) + rounded<T>(x1 * s));
    }
  }
}

// Constants of kernels/fp8_kv.py.
constexpr float kFp8Max = 448.0f;
constexpr float kFp8MinScale = 1e-12f;

// One row of d values -> its packed FP8 row (d bytes of float8_e4m3fn, then the float32
// scale), as quantize_rows computes it: scale = max(amax|x| / 448, 1e-12) in float32
// (or the static scale), each value x / scale (a true division, as torch's), clamped to
// +-448 and rounded to the nearest e4m3 by c10's conversion, the one torch's cast uses.
template <typename T>
inline void quantize_fp8_row(const T* x, int64_t d, float static_scale, uint8_t* dst) {
  float scale = static_scale;
  if (std::isnan(static_scale)) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
    scale = std::max(amax / kFp8Max, kFp8MinScale);
  }
  for (int64_t i = 0; i < d; ++i) {
    const float v = std::min(std::max(static_cast<float>(x[i]) / scale, -kFp8Max), kFp8Max);
    dst[i] = c10::Float8_e4m3fn(v).x;
  }
  std::memcpy(dst + d, &scale, sizeof(float));
}

}  // namespace decode_stack_detail

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor cos_sin_cache, at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), cos_sin_cache_(cos_sin_cache.contiguous()), final_norm_(std::move(final_norm)) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
    TORCH_CHECK(cos_sin_cache_.dim() == 2 && cos_sin_cache_.size(1) <= head_dim &&
                    cos_sin_cache_.size(1) % 2 == 0,
                "cos_sin_cache [max_position, rotary_dim <= head_dim, even]");
  }

  void add_layer(Linear qkv, Linear o, Linear gate_up, Linear down, at::Tensor input_norm,
                 at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, int64_t cache_layer,
                 std::optional<double> k_scale, std::optional<double> v_scale) {
    push(std::move(qkv), std::move(o), std::move(gate_up), std::move(down), std::nullopt,
         std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
         cache_layer, k_scale, v_scale);
  }

  // A layer whose MLP is a sparse MoE block (moe_block.h).
  void add_moe_layer(Linear qkv, Linear o, MoeBlock moe, at::Tensor input_norm,
                     at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                     std::optional<at::Tensor> k_norm, int64_t cache_layer,
                     std::optional<double> k_scale, std::optional<double> v_scale) {
    push(std::move(qkv), std::move(o), std::nullopt, std::nullopt, std::move(moe),
         std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
         cache_layer, k_scale, v_scale);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions,
                     const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    TORCH_CHECK(hidden.dim() == 2 && kv_cache.dim() == 6, "hidden [N, H], kv_cache [nb, L, 2, Hkv, bs, D]");
    const bool fp8 = kv_cache.scalar_type() == at::kByte;
    TORCH_CHECK((fp8 || hidden.scalar_type() == kv_cache.scalar_type()) &&
                    hidden.scalar_type() == cos_sin_cache_.scalar_type(),
                "hidden, KV cache (unless FP8) and rotary table must share the model dtype");
    TORCH_CHECK(kv_cache.size(3) == num_kv_heads_ &&
                    kv_cache.size(5) == head_dim_ + (fp8 ? paged_decode_detail::kScaleBytes : 0) &&
                    kv_cache.stride(5) == 1,
                "the KV cache's heads or head_dim differ from the model's");
    TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
                "positions and slot_mapping must be int64");
    TORCH_CHECK(positions.size(0) == hidden.size(0) && slot_mapping.size(0) == hidden.size(0),
                "one position and one slot per token");
    at::Tensor out;
    AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, hidden.scalar_type(), "decode_stack", [&] {
      out = run<scalar_t>(hidden, positions.contiguous(), kv_cache, slot_mapping.contiguous(),
                          block_tables, seq_lens);
    });
    return out;
  }

 private:
  void push(Linear qkv, Linear o, std::optional<Linear> gate_up, std::optional<Linear> down,
            std::optional<MoeBlock> moe, at::Tensor input_norm, at::Tensor post_norm,
            std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
            int64_t cache_layer, std::optional<double> k_scale, std::optional<double> v_scale) {
    const float none = std::numeric_limits<float>::quiet_NaN();
    layers_.push_back(DecoderLayer{std::move(qkv), std::move(o), std::move(gate_up),
                                   std::move(down), std::move(moe), input_norm.contiguous(),
                                   post_norm.contiguous(), std::move(q_norm), std::move(k_norm),
                                   cache_layer, k_scale ? static_cast<float>(*k_scale) : none,
                                   v_scale ? static_cast<float>(*v_scale) : none});
  }

  template <typename T>
  at::Tensor run(const at::Tensor& embedded, const at::Tensor& positions, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens) const {
    using namespace decode_stack_detail;
    const int64_t n = embedded.size(0), h = embedded.size(1), d = head_dim_;
    const int64_t q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
    const int64_t rot_dim = cos_sin_cache_.size(1), max_pos = cos_sin_cache_.size(0);
    const float eps = static_cast<float>(eps_);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < n; ++t)
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
    const T* cos_sin = cos_sin_cache_.data_ptr<T>();
    const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(4);
    for (int64_t t = 0; t < n; ++t)
      TORCH_CHECK(slots[t] < num_blocks * block_size, "slot ", slots[t], " outside the KV cache");
    const bool fp8 = kv_cache.scalar_type() == at::kByte;
    // Element strides: bytes for an FP8 cache, T's otherwise.
    uint8_t* cache8 = fp8 ? kv_cache.data_ptr<uint8_t>() : nullptr;
    T* cache = fp8 ? nullptr : kv_cache.data_ptr<T>();
    const int64_t cs0 = kv_cache.stride(0), cs1 = kv_cache.stride(1), cs2 = kv_cache.stride(2),
                  cs3 = kv_cache.stride(3), cs4 = kv_cache.stride(4);

    at::Tensor residual = embedded.contiguous().clone();  // the residual stream, updated in place
    at::Tensor normed = at::empty_like(residual);
    at::Tensor sub;  // the last sublayer's output, added to the residual by the next norm
    for (const DecoderLayer& layer : layers_) {
      add_rms_norm<T>(residual.data_ptr<T>(), sub.defined() ? sub.data_ptr<T>() : nullptr,
                      layer.input_norm.data_ptr<T>(), normed.data_ptr<T>(), n, h, h, h, eps);
      at::Tensor qkv = layer.qkv(normed).contiguous();  // [N, q_size + 2 * kv_size]
      T* qkv_ptr = qkv.data_ptr<T>();
      const int64_t width = qkv.size(1);
      {  // RoPE and the K/V store, token by token
        RECORD_FUNCTION("baton::rope_kv_store", std::vector<c10::IValue>());  // for the profiler
        for (int64_t t = 0; t < n; ++t) {
          T* q = qkv_ptr + t * width;
          T* k = q + q_size;
          if (layer.q_norm.has_value()) {  // Qwen3: each head normed over its D features
            add_rms_norm<T>(q, nullptr, layer.q_norm->data_ptr<T>(), q, num_heads_, d, d, d, eps);
            add_rms_norm<T>(k, nullptr, layer.k_norm->data_ptr<T>(), k, num_kv_heads_, d, d, d, eps);
          }
          const T* cs = cos_sin + pos[t] * rot_dim;
          rotate_heads<T>(q, num_heads_, d, cs, rot_dim);
          rotate_heads<T>(k, num_kv_heads_, d, cs, rot_dim);
          if (slots[t] < 0) continue;  // a token whose K/V is not kept
          const int64_t block = slots[t] / block_size, off = slots[t] % block_size;
          const int64_t row = block * cs0 + layer.cache_layer * cs1 + off * cs4;
          const T* v = k + kv_size;
          if (fp8) {
            for (int64_t kvh = 0; kvh < num_kv_heads_; ++kvh) {
              quantize_fp8_row<T>(k + kvh * d, d, layer.k_scale, cache8 + row + kvh * cs3);
              quantize_fp8_row<T>(v + kvh * d, d, layer.v_scale, cache8 + row + cs2 + kvh * cs3);
            }
            continue;
          }
          T* dst = cache + row;
          for (int64_t kvh = 0; kvh < num_kv_heads_; ++kvh) {
            std::memcpy(dst + kvh * cs3, k + kvh * d, d * sizeof(T));
            std::memcpy(dst + cs2 + kvh * cs3, v + kvh * d, d * sizeof(T));
          }
        }
      }
      at::Tensor query = qkv.narrow(1, 0, q_size).view({n, num_heads_, d});
      at::Tensor attn = paged_decode(query, kv_cache.select(1, layer.cache_layer), block_tables,
                                     seq_lens, scale_);
      at::Tensor o = layer.o(attn.reshape({n, q_size})).contiguous();
      add_rms_norm<T>(residual.data_ptr<T>(), o.data_ptr<T>(), layer.post_norm.data_ptr<T>(),
                      normed.data_ptr<T>(), n, h, h, h, eps);
      if (layer.moe.has_value()) {
        sub = (*layer.moe)(normed).contiguous();
        continue;
      }
      at::Tensor gate_up = (*layer.gate_up)(normed);  // [N, 2 * intermediate]
      at::Tensor act = silu_and_mul(gate_up);  // the CPU op set's (activation.h)
      sub = (*layer.down)(act).contiguous();
    }
    at::Tensor result = at::empty_like(residual);
    add_rms_norm<T>(residual.data_ptr<T>(), sub.defined() ? sub.data_ptr<T>() : nullptr,
                    final_norm_.data_ptr<T>(), result.data_ptr<T>(), n, h, h, h, eps);
    return result;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor cos_sin_cache_, final_norm_;
  std::vector<DecoderLayer> layers_;
};

}  // namespace baton
