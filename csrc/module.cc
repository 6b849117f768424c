// The extension module jax_grouped_mlp._kernels: exposes the FFI handlers as capsules.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;

namespace {

template <typename T>
py::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "not an XLA FFI handler");
  return py::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "AOT-compiled CuTe DSL kernels for jax_grouped_mlp, as XLA FFI handlers.";
  m.def("registrations", [] {
    py::dict d;
    auto add = [&d](const char* target, auto* instantiate, auto* execute) {
      py::dict handlers;
      handlers["instantiate"] = Capsule(instantiate);
      handlers["execute"] = Capsule(execute);
      d[target] = handlers;
    };
    add("jgm_fake_quantize_mxfp8", JgmFakeQuantizeInstantiate, JgmFakeQuantize);
    add("jgm_fake_quantize_pair", JgmFakeQuantizePairInstantiate, JgmFakeQuantizePair);
    add("jgm_dequantize_mxfp8", JgmDequantizeInstantiate, JgmDequantize);
    add("jgm_grouped_gemm", JgmGroupedGemmInstantiate, JgmGroupedGemm);
    add("jgm_grouped_wgrad", JgmGroupedWgradInstantiate, JgmGroupedWgrad);
    add("jgm_grouped_gemm_fc1", JgmGroupedGemmFc1Instantiate, JgmGroupedGemmFc1);
    add("jgm_grouped_gemm_dgrad", JgmGroupedGemmDgradInstantiate, JgmGroupedGemmDgrad);
    return d;
  });
  auto names = [](const char* const* list, int count) {
    py::list out;
    for (int i = 0; i < count; ++i) out.append(list[i]);
    return py::tuple(out);
  };
  m.attr("FAKE_QUANTIZE_VARIANTS") =
      names(jgm::kFakeQuantizeVariants, jgm::kNumFakeQuantizeVariants);
  m.attr("DEQUANTIZE_VARIANTS") = names(jgm::kDequantizeVariants, jgm::kNumDequantizeVariants);
  m.attr("FAKE_QUANTIZE_PAIR_VARIANTS") =
      names(jgm::kFakeQuantizePairVariants, jgm::kNumFakeQuantizePairVariants);
  m.attr("GROUPED_GEMM_VARIANTS") = names(jgm::kGroupedGemmVariants, jgm::kNumGroupedGemmVariants);
  m.attr("GROUPED_WGRAD_VARIANTS") =
      names(jgm::kGroupedWgradVariants, jgm::kNumGroupedWgradVariants);
  m.attr("GROUPED_GEMM_FC1_VARIANTS") =
      names(jgm::kGroupedGemmFc1Variants, jgm::kNumGroupedGemmFc1Variants);
  m.attr("GROUPED_GEMM_DGRAD_VARIANTS") =
      names(jgm::kGroupedGemmDgradVariants, jgm::kNumGroupedGemmDgradVariants);
  m.attr("ARCH") = "sm_90a";
}
