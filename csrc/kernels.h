// Shared helpers for the XLA FFI handlers around our AOT-compiled CuTe DSL kernels.
//
// Each kernel variant is a header + object pair exported by
// jax_grouped_mlp/kernels/aot.py (``export_to_c``). Its header defines a module
// type, ``<name>_Kernel_Module_Load`` (loads the cubin into every device, once) and
// ``cute_dsl_<name>_wrapper`` (launches on a stream). The handlers below validate
// XLA's buffers, make sure the module is loaded, and call the wrapper.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jgm {

namespace ffi = xla::ffi;

// The exported module-load helpers report CUDA errors through this macro; we keep
// the first error instead of printing it.
inline thread_local cudaError_t tls_load_error = cudaSuccess;

}  // namespace jgm

#define CUTE_DSL_CUDA_ERROR_CHECK(err)                                          \
  do {                                                                          \
    cudaError_t jgm_err_ = (err);                                               \
    if (jgm_err_ != cudaSuccess && ::jgm::tls_load_error == cudaSuccess)        \
      ::jgm::tls_load_error = jgm_err_;                                         \
  } while (0)

namespace jgm {

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// InvalidArgument unless `buf` has exactly `dims` and element type `dtype`.
inline ffi::Error CheckBuffer(const char* name, const ffi::AnyBuffer& buf,
                              ffi::DataType dtype,
                              std::initializer_list<int64_t> dims) {
  if (buf.element_type() != dtype) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": wrong element type (data type enum " +
        std::to_string(static_cast<int>(buf.element_type())) + ", expected " +
        std::to_string(static_cast<int>(dtype)) + ")");
  }
  auto got = buf.dimensions();
  bool same = got.size() == dims.size();
  size_t i = 0;
  for (int64_t d : dims) {
    if (!same) break;
    same = got[i++] == d;
  }
  if (!same) {
    std::string want = "[";
    i = 0;
    for (int64_t d : dims) want += (i++ ? ", " : "") + std::to_string(d);
    return ffi::Error::InvalidArgument(std::string(name) + ": shape " +
                                       DimsToString(got) + ", expected " + want + "]");
  }
  return ffi::Error::Success();
}

// Loads a kernel module into every device exactly once per process, thread-safely.
// `load` is the exported <name>_Kernel_Module_Load bound to a static module object.
class ModuleOnce {
 public:
  template <typename LoadFn>
  ffi::Error Ensure(const char* name, LoadFn load) {
    std::call_once(once_, [&] {
      tls_load_error = cudaSuccess;
      load();
      error_ = tls_load_error;
      tls_load_error = cudaSuccess;
    });
    if (error_ != cudaSuccess) {
      return ffi::Error::Internal(std::string(name) + ": loading the kernel module failed: " +
                                  cudaGetErrorString(error_));
    }
    return ffi::Error::Success();
  }

 private:
  std::once_flag once_;
  cudaError_t error_ = cudaSuccess;
};

// The persistent kernels launch one CTA per SM of the stream's device.
inline ffi::Error NumSms(const char* name, cudaStream_t stream, int32_t* num_sms) {
  int device = 0;
  cudaError_t err = cudaStreamGetDevice(stream, &device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string(name) + ": reading the SM count failed: " +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Each handler family lists its exported variants as an X-macro, LIST(X) expanding
// X(name, ...) per variant in the order of the `variant` attribute (extra arguments
// are per-variant facts the family's handler reads). The lists are generated from
// jax_grouped_mlp/kernels/registry.py into build/kernels/jgm_variants.h (with the
// variants' exported headers) by tools/build_kernels.py. With these, a family writes
//   const char* const kNames[] = {LIST(JGM_VARIANT_NAME)};
//   LIST(JGM_VARIANT_MODULE)                      // at namespace scope
//   int32_t i = 0; LIST(JGM_VARIANT_LOAD) ...     // in LoadModule(variant), with kName
#define JGM_VARIANT_NAME(name, ...) #name,
#define JGM_VARIANT_MODULE(name, ...) \
  name##_Kernel_Module_t g_##name;    \
  ModuleOnce g_once_##name;
#define JGM_VARIANT_LOAD(name, ...) \
  if (variant == i++)               \
    return g_once_##name.Ensure(kName, [] { name##_Kernel_Module_Load(&g_##name); });

// The error for a `variant` attribute past the compiled list.
inline ffi::Error VariantOutOfRange(const char* name, int32_t variant, int count) {
  return ffi::Error::InvalidArgument(std::string(name) + ": attribute variant=" +
                                     std::to_string(variant) + " out of range [0, " +
                                     std::to_string(count) + ")");
}

inline ffi::Error LaunchResult(const char* name, int32_t ret) {
  if (ret != 0) {
    return ffi::Error::Internal(std::string(name) + ": kernel launch failed: " +
                                cudaGetErrorString(static_cast<cudaError_t>(ret)));
  }
  cudaError_t err = cudaPeekAtLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(name) + ": kernel launch failed: " +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace jgm

namespace jgm {
// Names of the compiled grouped GEMM variants, indexed by the `variant` attribute.
extern const char* const kGroupedGemmVariants[];
extern const int kNumGroupedGemmVariants;
// Names of the compiled fake-quantize variants, indexed by `variant`.
extern const char* const kFakeQuantizeVariants[];
extern const int kNumFakeQuantizeVariants;
extern const char* const kDequantizeVariants[];
extern const int kNumDequantizeVariants;
extern const char* const kFakeQuantizePairVariants[];
extern const int kNumFakeQuantizePairVariants;
// Names of the compiled grouped weight-gradient variants, indexed by `variant`.
extern const char* const kGroupedWgradVariants[];
extern const int kNumGroupedWgradVariants;
// Names of the compiled grouped GEMM variants with the FC1 epilogue, by `variant`.
extern const char* const kGroupedGemmFc1Variants[];
extern const int kNumGroupedGemmFc1Variants;
// Names of the compiled grouped GEMM variants with the FC2-dgrad epilogue, by `variant`.
extern const char* const kGroupedGemmDgradVariants[];
extern const int kNumGroupedGemmDgradVariants;
}  // namespace jgm

// Handlers defined in the per-family .cc files (registered in module.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmFakeQuantizeInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmFakeQuantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmDequantizeInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmDequantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmFakeQuantizePairInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmFakeQuantizePair);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedWgradInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedWgrad);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmFc1Instantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmFc1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmDgradInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmDgrad);
