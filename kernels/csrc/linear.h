// One linear layer's multiply as the eager layer's ``matmul`` does it (kernels/cpu_linear.py,
// kernels/int4_linear.py, F.linear), for the C++ decoder-layer stack (decode_stack.h) and
// its MoE blocks' shared expert (moe_block.h).
//
// Layouts: x [rows, in] -> [rows, out]; ``weight`` as the eager layer holds it ([out, in]
// dense, oneDNN's packed tensor, or the int4 pack with its scale_zeros).
#pragma once

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

namespace baton {

// One linear layer's multiply, as the eager layer's ``matmul`` does it.
struct Linear {
  enum class Kind { kDense, kOneDnn, kInt4 };

  Linear(const std::string& kind, at::Tensor weight, std::optional<at::Tensor> bias,
         std::optional<at::Tensor> scale_zeros, int64_t group_size)
      : weight(std::move(weight)), bias(std::move(bias)), scale_zeros(std::move(scale_zeros)),
        group_size(group_size) {
    if (kind == "dense") {
      this->kind = Kind::kDense;
    } else if (kind == "onednn") {
      this->kind = Kind::kOneDnn;
    } else if (kind == "int4") {
      TORCH_CHECK(this->scale_zeros.has_value(), "an int4 linear needs its scale_zeros");
      this->kind = Kind::kInt4;
    } else {
      TORCH_CHECK(false, "unknown linear kind '", kind, "' (dense, onednn, int4)");
    }
  }

  // Batch-invariant models (model.deterministic, kernels/batch_invariant.py): fewer rows
  // than min_rows are multiplied beside copies of the first, as RowPadded does in Python
  // (one row alone may take a matrix-vector path that sums in another order).
  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (rows == 0 || rows >= min_rows) return multiply(x);
    return multiply(x.narrow(0, 0, 1).expand({min_rows, x.size(1)}).contiguous()).narrow(0, 0, rows);
  }

  at::Tensor multiply(const at::Tensor& x) const {
    switch (kind) {
      case Kind::kDense:
        return at::linear(x, weight, bias);
      case Kind::kOneDnn: {
        // torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""), as
        // kernels/cpu_linear.py calls it; the op has no public C++ header, so boxed.
        static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
            "mkldnn::_linear_pointwise", "");
        std::vector<c10::IValue> stack;
        stack.reserve(6);
        stack.emplace_back(x);
        stack.emplace_back(weight);
        stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
        stack.emplace_back(std::string("none"));
        stack.emplace_back(c10::List<std::optional<at::Scalar>>());
        stack.emplace_back(std::string(""));
        op.callBoxed(&stack);
        return stack[0].toTensor();
      }
      case Kind::kInt4: {
        // As kernels/int4_linear.py int4_linear_cpu: bfloat16 activations, the result
        // back in x's dtype, then the bias.
        auto out = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), weight, group_size,
                                                   *scale_zeros)
                       .to(x.scalar_type());
        if (bias.has_value()) out = out + *bias;
        return out;
      }
    }
    return at::Tensor();
  }

  Kind kind = Kind::kDense;
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  std::optional<at::Tensor> scale_zeros;
  int64_t group_size = 0;
  int64_t min_rows = 1;
};

}  // namespace baton
