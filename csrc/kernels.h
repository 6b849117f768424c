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
// are per-variant facts the family's handler reads). With these, a family writes
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

// The persistent grid after leaving `reserve` SMs to a kernel run beside it (at least 1 CTA).
inline int32_t PersistentCtas(int32_t num_sms, int32_t reserve) {
  return num_sms - reserve > 0 ? num_sms - reserve : 1;
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

// A second stream per device for memory-bound work run beside a compute-bound
// persistent kernel (RunBeside). Created on first use, kept for the process.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;  // recorded on the caller's stream: the inputs are ready
  cudaEvent_t join = nullptr;  // recorded on the side stream: the side work is done
  std::mutex mu;               // one fork/launch/join sequence at a time
};

inline ffi::Error GetSideStream(const char* name, cudaStream_t stream, SideStream** out) {
  constexpr int kMaxDevices = 64;
  static std::mutex mu;
  static SideStream* per_device[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaStreamGetDevice(stream, &device);
  if (err == cudaSuccess && (device < 0 || device >= kMaxDevices)) err = cudaErrorInvalidDevice;
  if (err == cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu);
    if (per_device[device] == nullptr) {
      int current = 0;
      err = cudaGetDevice(&current);
      if (err == cudaSuccess) err = cudaSetDevice(device);
      auto* fresh = new SideStream();  // process lifetime (never destroyed)
      if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&fresh->stream, cudaStreamNonBlocking);
      if (err == cudaSuccess) err = cudaEventCreateWithFlags(&fresh->fork, cudaEventDisableTiming);
      if (err == cudaSuccess) err = cudaEventCreateWithFlags(&fresh->join, cudaEventDisableTiming);
      cudaSetDevice(current);
      if (err == cudaSuccess) per_device[device] = fresh;
    }
    *out = per_device[device];
  }
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string(name) + ": creating the side stream failed: " +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Runs main_fn(stream) and side_fn(side stream) at the same time; work queued on
// `stream` afterwards starts only when both are done. The side stream first waits
// for everything queued on `stream` so far (the inputs of both). main_fn launches
// first, so a persistent kernel that leaves SMs free (PersistentCtas) keeps its SMs,
// and the side kernel's CTAs run on the free ones.
template <typename MainFn, typename SideFn>
ffi::Error RunBeside(const char* name, cudaStream_t stream, MainFn main_fn, SideFn side_fn) {
  SideStream* side = nullptr;
  if (auto e = GetSideStream(name, stream, &side); e.failure()) return e;
  std::lock_guard<std::mutex> lock(side->mu);
  cudaError_t err = cudaEventRecord(side->fork, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(side->stream, side->fork, 0);
  if (err != cudaSuccess) return LaunchResult(name, static_cast<int32_t>(err));
  ffi::Error main_err = main_fn(stream);
  ffi::Error side_err = side_fn(side->stream);
  err = cudaEventRecord(side->join, side->stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, side->join, 0);
  if (main_err.failure()) return main_err;
  if (side_err.failure()) return side_err;
  return LaunchResult(name, static_cast<int32_t>(err));
}

// The fake-quantize launch (fake_quantize_mxfp8.cc), for side work: validates, loads
// the module, launches variant `variant` of JGM_FAKE_QUANTIZE_VARIANTS on `stream`.
ffi::Error FakeQuantizeOn(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                          ffi::Result<ffi::AnyBuffer> out, int32_t variant);
ffi::Error FakeQuantizeLoad(int32_t variant);

}  // namespace jgm

namespace jgm {
// Names of the compiled quantize variants, indexed by the `variant` attribute.
extern const char* const kQuantizeVariants[];
extern const int kNumQuantizeVariants;
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
// Names of the compiled grouped GEMM variants with in-kernel MXFP8 weights, by `variant`.
extern const char* const kGroupedGemmW8Variants[];
extern const int kNumGroupedGemmW8Variants;
// Names of the compiled grouped GEMM variants with the FC1 epilogue, by `variant`.
extern const char* const kGroupedGemmFc1Variants[];
extern const int kNumGroupedGemmFc1Variants;
}  // namespace jgm

// Handlers defined in the per-family .cc files (registered in module.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmQuantizeMxfp8Instantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmQuantizeMxfp8);
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
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmW8Instantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmW8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmFc1Instantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmFc1);
// The same GEMMs with a weight fake-quantize run beside them (RunBeside).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmBesideInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmBeside);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedWgradBesideInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedWgradBeside);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmFc1BesideInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmGroupedGemmFc1Beside);
