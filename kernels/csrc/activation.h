// silu(gate) * up, the gated MLP activation, on CPU: the one the C++ layer stack
// (decode_stack.h) uses and, through kernels/__init__.py's CPU op set, the one the eager
// CPU layers use, so that both give the same bits.
//
// Why not ATen's: silu on the gate half of the fused gate_up output (a strided view) and
// the multiply are two passes and two dispatches: 13.9 us for 32 rows of 2 x 1536 on the
// 2-core VM, against 7.5 us for this one vectorized pass (30 layers: 0.2 ms a step).
//
// Numerics as kernels/activation.py: silu(g) = g / (1 + exp(-g)) in float32 (as ATen
// computes it), rounded to the model dtype, times up, rounded. exp is exp_poly.h's, within
// 2 ulp of libm's (ATen's differs from libm's too); overflow gives inf, so g -> -inf
// gives -0 as ATen does.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>

#include "exp_poly.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace baton {
namespace activation_detail {

// Below this exp(x) is so small that 1 + it == 1 in float32.
constexpr float kLowestExp = -87.3f;

// One row: out[i] = round(round(silu(gate[i])) * up[i]).
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i);
      const __m512 e = exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), g), kLowestExp);
      const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float s = static_cast<float>(static_cast<T>(g / (1.0f + exp_poly(-g, kLowestExp))));
    out[i] = static_cast<T>(s * static_cast<float>(up[i]));
  }
}

}  // namespace activation_detail

// x [..., 2 * d] (gate, then up) -> [..., d]: a new tensor, x untouched.
inline torch::Tensor silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: the last dim must be even");
  RECORD_FUNCTION("baton::silu_and_mul", std::vector<c10::IValue>());  // for torch's profiler
  auto input = x.contiguous();
  const int64_t width = input.size(-1), d = width / 2, rows = width ? input.numel() / width : 0;
  auto sizes = input.sizes().vec();
  sizes.back() = d;
  auto out = torch::empty(sizes, input.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, input.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = input.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // Rows split across threads once there is enough work to pay for waking them.
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        activation_detail::silu_mul_row<scalar_t>(in + r * width, in + r * width + d, o + r * d, d);
    });
  });
  return out;
}

}  // namespace baton
