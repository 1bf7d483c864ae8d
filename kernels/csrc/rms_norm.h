// RMSNorm, optionally after the residual add, on CPU: the one the C++ layer stack
// (decode_stack.h) uses and, through kernels/cpu_ops.py, the one the eager CPU layers use,
// so that a decode step gives the same bits whichever of the two runs it.
//
// Numerics as kernels/rms_norm.py (Hugging Face's LlamaRMSNorm): the residual sum rounded
// to the model dtype, the mean of squares in float32, the scaled row rounded to the model
// dtype, then times the weight in that dtype. Only the order of the float32 sum differs
// from torch's reduction; the module is built with -ffp-contract=off, so no product and
// sum are fused into one rounding where the eager ops round twice.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <tuple>

namespace baton {
namespace decode_stack_detail {

// What an eager op would store: the value rounded to the model dtype (identity for float).
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// rows x [n, h] (row stride ld; out rows out_ld apart): out = w * rms_norm(x), after x += add when add is given
// (x is then the new residual stream). As kernels/rms_norm.py: float32 mean of squares,
// scaled row rounded to T, then times the weight in T.
template <typename T>
void add_rms_norm(T* x, const T* add, const T* w, T* out, int64_t n, int64_t h, int64_t ld,
                  int64_t out_ld, float eps) {
  RECORD_FUNCTION("baton::rms_norm", std::vector<c10::IValue>());  // for torch's profiler
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* xr = x + row * ld;
      if (add != nullptr) {
        const T* ar = add + row * h;
        for (int64_t i = 0; i < h; ++i) xr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(ar[i]));
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < h; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
      T* o = out + row * out_ld;
      for (int64_t i = 0; i < h; ++i)
        o[i] = static_cast<T>(static_cast<float>(w[i]) * rounded<T>(static_cast<float>(xr[i]) * inv));
    }
  });
}

}  // namespace decode_stack_detail

// ``weight * rms_norm(x)`` over the last dim of x (any leading dims): a new tensor.
inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.size(-1) == weight.numel() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: weight must be [hidden] of x's dtype");
  auto input = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(input);
  const int64_t h = input.size(-1), n = h ? input.numel() / h : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, input.scalar_type(), "rms_norm", [&] {
    decode_stack_detail::add_rms_norm<scalar_t>(input.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                                                out.data_ptr<scalar_t>(), n, h, h, h, static_cast<float>(eps));
  });
  return out;
}

// (weight * rms_norm(x + residual), x + residual): new tensors, the inputs untouched.
inline std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(const torch::Tensor& x,
                                                                   const torch::Tensor& residual,
                                                                   const torch::Tensor& weight,
                                                                   double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "fused_add_rms_norm: x and residual differ in shape or dtype");
  TORCH_CHECK(x.size(-1) == weight.numel() && x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: weight must be [hidden] of x's dtype");
  auto sum = residual.contiguous().clone();
  auto add = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(sum);
  const int64_t h = sum.size(-1), n = h ? sum.numel() / h : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, sum.scalar_type(), "fused_add_rms_norm", [&] {
    decode_stack_detail::add_rms_norm<scalar_t>(sum.data_ptr<scalar_t>(), add.data_ptr<scalar_t>(),
                                                w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, h, h, h,
                                                static_cast<float>(eps));
  });
  return {out, sum};
}

}  // namespace baton
