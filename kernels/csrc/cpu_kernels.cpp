// The CPU kernels' Python module (built by kernels/cpu_extension.py): decode attention over
// the paged KV cache (paged_decode.h), RMSNorm (rms_norm.h), SiLU-and-multiply
// (activation.h) and the fused decoder-layer stack (decode_stack.h) with its MoE blocks
// (moe_block.h), and the MoE experts' few-row multiply (matvec.h).
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "activation.h"
#include "decode_stack.h"
#include "matvec.h"
#include "moe_block.h"
#include "paged_decode.h"
#include "rms_norm.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &baton::paged_decode, "Decode attention over the paged KV cache (CPU)",
        py::arg("query"), py::arg("kv_cache_layer"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &baton::rms_norm, "weight * rms_norm(x) over the last dim (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("eps"));
  m.def("fused_add_rms_norm", &baton::fused_add_rms_norm,
        "(weight * rms_norm(x + residual), x + residual) (CPU)", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &baton::silu_and_mul, "silu(x[..., :d]) * x[..., d:] (CPU)", py::arg("x"));
  m.def("expert_matvec", &baton::expert_matvec, "x @ w.t() for 1..4 float32 rows (CPU)",
        py::arg("x"), py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.attr("MATVEC_MAX_ROWS") = baton::kMatvecMaxRows;
  py::class_<baton::Linear>(m, "Linear")
      .def(py::init<const std::string&, at::Tensor, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, int64_t>(),
           py::arg("kind"), py::arg("weight"), py::arg("bias"), py::arg("scale_zeros"),
           py::arg("group_size"))
      .def_readwrite("min_rows", &baton::Linear::min_rows);
  py::class_<baton::MoeBlock>(m, "MoeBlock")
      .def(py::init<at::Tensor, std::vector<baton::Linear>, std::vector<baton::Linear>,
                    std::vector<baton::Linear>, std::vector<baton::Linear>, int64_t, int64_t,
                    bool, at::Tensor, std::optional<baton::Linear>, std::optional<baton::Linear>,
                    std::optional<at::Tensor>>(),
           py::arg("gate"), py::arg("gate_up"), py::arg("down"), py::arg("packed_gate_up"),
           py::arg("packed_down"), py::arg("packed_min_rows"), py::arg("top_k"),
           py::arg("renormalize"), py::arg("expert_tokens"), py::arg("shared_gate_up"),
           py::arg("shared_down"), py::arg("shared_gate"))
      .def_readwrite("matvec_max_rows", &baton::MoeBlock::matvec_max_rows)
      .def("__call__", &baton::MoeBlock::operator(), py::arg("x"),
           py::call_guard<py::gil_scoped_release>());
  py::class_<baton::DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"), py::arg("cos_sin_cache"), py::arg("final_norm"))
      .def("add_layer", &baton::DecodeStack::add_layer, py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("input_norm"), py::arg("post_norm"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("cache_layer"), py::arg("k_scale"),
           py::arg("v_scale"))
      .def("add_moe_layer", &baton::DecodeStack::add_moe_layer, py::arg("qkv"), py::arg("o"),
           py::arg("moe"), py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("cache_layer"), py::arg("k_scale"), py::arg("v_scale"))
      .def_property_readonly("num_layers", &baton::DecodeStack::num_layers)
      .def("forward", &baton::DecodeStack::forward, py::arg("hidden"), py::arg("positions"),
           py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("seq_lens"), py::call_guard<py::gil_scoped_release>());
}
