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
    py::dict quantize;
    quantize["instantiate"] = Capsule(JgmQuantizeMxfp8Instantiate);
    quantize["execute"] = Capsule(JgmQuantizeMxfp8);
    d["jgm_quantize_mxfp8"] = quantize;
    py::dict fake_quantize;
    fake_quantize["instantiate"] = Capsule(JgmFakeQuantizeInstantiate);
    fake_quantize["execute"] = Capsule(JgmFakeQuantize);
    d["jgm_fake_quantize_mxfp8"] = fake_quantize;
    py::dict grouped_gemm;
    grouped_gemm["instantiate"] = Capsule(JgmGroupedGemmInstantiate);
    grouped_gemm["execute"] = Capsule(JgmGroupedGemm);
    d["jgm_grouped_gemm"] = grouped_gemm;
    py::dict grouped_wgrad;
    grouped_wgrad["instantiate"] = Capsule(JgmGroupedWgradInstantiate);
    grouped_wgrad["execute"] = Capsule(JgmGroupedWgrad);
    d["jgm_grouped_wgrad"] = grouped_wgrad;
    return d;
  });
  py::list variants;
  for (int i = 0; i < jgm::kNumQuantizeVariants; ++i) variants.append(jgm::kQuantizeVariants[i]);
  m.attr("QUANTIZE_VARIANTS") = py::tuple(variants);
  py::list fake_variants;
  for (int i = 0; i < jgm::kNumFakeQuantizeVariants; ++i)
    fake_variants.append(jgm::kFakeQuantizeVariants[i]);
  m.attr("FAKE_QUANTIZE_VARIANTS") = py::tuple(fake_variants);
  py::list gemm_variants;
  for (int i = 0; i < jgm::kNumGroupedGemmVariants; ++i)
    gemm_variants.append(jgm::kGroupedGemmVariants[i]);
  m.attr("GROUPED_GEMM_VARIANTS") = py::tuple(gemm_variants);
  py::list wgrad_variants;
  for (int i = 0; i < jgm::kNumGroupedWgradVariants; ++i)
    wgrad_variants.append(jgm::kGroupedWgradVariants[i]);
  m.attr("GROUPED_WGRAD_VARIANTS") = py::tuple(wgrad_variants);
  m.attr("ARCH") = "sm_90a";
}
