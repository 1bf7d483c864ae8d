// A few rows times a float32 weight, y = x w^T, for the MoE experts' decode multiplies
// (moe_block.h, and kernels/moe.py's PackedExperts in the eager path: the same function,
// so the same bits).
//
// Why: in a decode step an expert gets one or two rows, and the multiply is a pass over
// its weight (2.4 MB per expert of Qwen3-MoE-small). MKL's one-row sgemm read it at about
// 14 GB/s on the 2-vCPU AMD VM, oneDNN's one-row path no faster; a plain loop of
// vector multiply-adds over the weight rows, the output rows split over torch's threads,
// reads it near the machine's bandwidth (2-3x MKL's at 1-4 rows there, at or above
// oneDNN's from 2 rows on; from 6 rows on oneDNN wins, so at most 4). Whether it wins
// is timed at load (kernels/moe.py ``choose_matvec_rows``), as packing is.
//
// Exactness: each output element is one thread's dot product in a fixed order (16-lane
// partial sums over the inner dimension, fused multiply-adds where the CPU has AVX-512,
// then the lanes in order, then the tail), so the result does not depend on the thread
// count or on which output block holds the element. It is not MKL's order: within float32
// rounding of ``x @ w.t()``, not its bits (tests/kernels/test_expert_matvec.py).
//
// Layouts: x [rows, in] float32 (any row stride, unit column stride); w [out, in] float32
// contiguous; returns [rows, out] float32 contiguous. rows in 1..kMatvecMaxRows.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace baton {

constexpr int64_t kMatvecMaxRows = 4;

namespace matvec_detail {

constexpr int kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

// acc + a * b: one rounding where the CPU has a vector FMA (half the arithmetic, which
// from three rows on is what bounds the loop, not the weight's bytes), two elsewhere.
// Either way the same on every call, so the eager path and the stack agree.
inline Vec multiply_add(Vec a, Vec b, Vec acc) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, acc);
#else
  return acc + a * b;
#endif
}

// Outputs [o0, o0 + kOut) of R rows: one pass over those weight rows.
template <int R, int kOut>
inline void block(const float* x, int64_t x_stride, const float* w, int64_t in, int64_t o0,
                  float* y, int64_t out) {
  Vec acc[R][kOut];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kOut; ++j) acc[r][j] = Vec{};
  const int64_t body = in - in % kLanes;
  for (int64_t c = 0; c < body; c += kLanes) {
    Vec xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = load(x + r * x_stride + c);
#pragma GCC unroll 4
    for (int j = 0; j < kOut; ++j) {
      const Vec wv = load(w + (o0 + j) * in + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = multiply_add(xv[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kOut; ++j) {
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += acc[r][j][l];
      const float* wr = w + (o0 + j) * in;
      for (int64_t c = body; c < in; ++c) sum += x[r * x_stride + c] * wr[c];
      y[r * out + o0 + j] = sum;
    }
  }
}

template <int R>
void rows_times(const float* x, int64_t x_stride, const float* w, int64_t in, int64_t out,
                float* y) {
  constexpr int kOut = 4;  // accumulators: R * kOut <= 16 vectors, of 32 registers
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + kOut <= end; o += kOut) block<R, kOut>(x, x_stride, w, in, o, y, out);
    for (; o < end; ++o) block<R, 1>(x, x_stride, w, in, o, y, out);
  });
}

}  // namespace matvec_detail

// x [rows, in] @ w[out, in]^T -> [rows, out], float32 (module comment).
inline at::Tensor expert_matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "expert_matvec: x [rows, in] and w [out, in], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "expert_matvec: float32 only");
  TORCH_CHECK(w.is_contiguous(), "expert_matvec: w must be contiguous");
  const int64_t rows = x.size(0), in = w.size(1), out = w.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMatvecMaxRows, "expert_matvec: 1..", kMatvecMaxRows,
              " rows, got ", rows);
  at::Tensor input = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = input.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = input.stride(0);
  switch (rows) {
    case 1: matvec_detail::rows_times<1>(xp, stride, wp, in, out, yp); break;
    case 2: matvec_detail::rows_times<2>(xp, stride, wp, in, out, yp); break;
    case 3: matvec_detail::rows_times<3>(xp, stride, wp, in, out, yp); break;
    default: matvec_detail::rows_times<4>(xp, stride, wp, in, out, yp); break;
  }
  return y;
}

}  // namespace baton
