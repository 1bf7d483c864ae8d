// silu(gate) * up, the gated MLP activation, on CPU: the one the C++ layer stack
// (decode_stack.h) uses and, through kernels/__init__.py's CPU op set, the one the eager
// CPU layers use, so that both give the same bits.
//
// Why not ATen's: silu on the gate half of the fused gate_up output (a strided view) and
// the multiply are two passes and two dispatches: 13.9 us for 32 rows of 2 x 1536 on the
// 2-core VM, against 7.5 us for this one vectorized pass (30 layers: 0.2 ms a step).
//
// Numerics as kernels/activation.py: silu(g) = g / (1 + exp(-g)) in float32 (as ATen
// computes it), rounded to the model dtype, times up, rounded. exp is a polynomial within
// 2 ulp of libm's (ATen's differs from libm's too); overflow gives inf, so g -> -inf
// gives -0 as ATen does.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace baton {
namespace activation_detail {

// exp(x): Cephes' expf polynomial after range reduction by powers of two; below -87.3 the
// result is the smallest normal range (1 + it == 1 in float32 anyway).
inline float exp_poly(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return std::ldexp(y, static_cast<int>(n));
}

#if defined(__AVX512F__)
inline __m512 exp_poly16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_add_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
                                 _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);  // y * 2^n: overflows to inf as ldexp does
}
#endif

// One row: out[i] = round(round(silu(gate[i])) * up[i]).
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i);
      const __m512 e = exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float s = static_cast<float>(static_cast<T>(g / (1.0f + exp_poly(-g))));
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
