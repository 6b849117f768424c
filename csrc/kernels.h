// What every XLA FFI handler around our AOT-compiled CuTe DSL kernels shares: typed
// operands, the one shape check, module loading at instantiate, the one launch path.
//
// A kernel variant is a header + object pair exported by kernels/aot.py: a module type,
// <name>_Kernel_Module_Load (cudaLibraryLoadData, then per device cudaLibraryGetKernel and
// the shared-memory attribute) and cute_dsl_<name>_wrapper, whose compiled body only packs
// the parameters and calls cudaLaunchKernelExC (objdump -dr of any kernel object).
//
// CUDA graphs: what stream capture forbids happens at instantiate, once per process:
// loading the module, finishing CUDA's lazy loading of its kernels on the devices in use
// (else their first launch loads them: "operation not permitted when stream is
// capturing"), reading the SM counts. Execute only memsets and launches; it is exported
// twice, <Sym> marked kCmdBufferCompatible and <Sym>NoGraph not (module.cc).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jgm {
namespace ffi = xla::ffi;
// The exported module loaders report CUDA errors through this macro: keep the first.
inline thread_local cudaError_t tls_load_error = cudaSuccess;
}  // namespace jgm
#define CUTE_DSL_CUDA_ERROR_CHECK(err)                                                 \
  do {                                                                                 \
    cudaError_t jgm_err_ = (err);                                                      \
    if (jgm_err_ != cudaSuccess && ::jgm::tls_load_error == cudaSuccess)              \
      ::jgm::tls_load_error = jgm_err_;                                                \
  } while (0)

namespace jgm {

// Typed operands: XLA checks element type and rank before a handler runs. The FFI has no
// typed buffer for FP8 (no native C++ type): those are Fp8, checked by Check::Shape/Type.
using Bf16R2 = ffi::BufferR2<ffi::BF16>;
using Bf16R3 = ffi::BufferR3<ffi::BF16>;
using F32R1 = ffi::BufferR1<ffi::F32>;
using F32R2 = ffi::BufferR2<ffi::F32>;
using S32R1 = ffi::BufferR1<ffi::S32>;
using Fp8 = ffi::AnyBuffer;
template <typename T>
using Out = ffi::Result<T>;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Dimension i of an untyped operand, -1 past its rank (Check::Shape then rejects it).
inline int64_t Dim(const ffi::AnyBuffer& buf, size_t i) {
  return i < buf.dimensions().size() ? buf.dimensions()[i] : -1;
}

// The checks that keep a launch inside its buffers, each written once; the first failure
// becomes InvalidArgument naming the handler, the argument and what was expected.
class Check {
 public:
  explicit Check(const char* handler) : handler_(handler) {}
  // `arg` has exactly the dimensions `want` (spelled e.g. "[M, N]") and fewer than 2^31
  // elements (the kernels index with 32-bit offsets).
  template <typename Buffer>
  Check& Shape(const char* arg, const Buffer& buf, const char* spelled,
               std::initializer_list<int64_t> want) {
    auto got = buf.dimensions();
    auto dims = [](const int64_t* d, size_t n) {
      std::string s = "[";
      for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
      return s + "]";
    };
    bool same = got.size() == want.size();
    int64_t count = 1, i = 0;
    for (int64_t d : want) same = same && got[i++] == d, count *= d;
    if (!same)
      return Fail(std::string(arg) + " must be " + spelled + " = " +
                  dims(want.begin(), want.size()) + ", got " + dims(got.begin(), got.size()));
    return Fail(count >> 31 ? std::string(arg) + " has 2^31 or more elements" : "");
  }
  // `what` (K or N) is a multiple of 8: TMA needs 16-byte strides of bf16 rows.
  Check& Multiple8(const char* what, int64_t v) {
    return Fail(v % 8 ? std::string(what) + "=" + std::to_string(v) + " must be a multiple of 8"
                      : "");
  }
  // `what` is a multiple of `d` (FP8 rows: TMA needs 16-byte strides, so K % 16 == 0).
  Check& MultipleOf(const char* what, int64_t v, int64_t d) {
    return Fail(v % d ? std::string(what) + "=" + std::to_string(v) + " must be a multiple of " +
                            std::to_string(d)
                      : "");
  }
  // `what` is at least `lo`.
  Check& AtLeast(const char* what, int64_t v, int64_t lo) {
    return Fail(v < lo ? std::string(what) + "=" + std::to_string(v) + " must be at least " +
                             std::to_string(lo)
                       : "");
  }
  // `arg` (untyped: FP8, or a type the variant decides) has element type `want`.
  Check& Type(const char* arg, ffi::DataType got, ffi::DataType want) {
    std::ostringstream m;
    if (got != want) m << arg << " must be " << want << ", got " << got;
    return Fail(m.str());
  }
  ffi::Error Result() const {
    if (error_.empty()) return ffi::Error::Success();
    return ffi::Error::InvalidArgument(std::string(handler_) + ": " + error_);
  }

 private:
  Check& Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return *this;
  }
  const char* handler_;
  std::string error_;
};

// An exported tensor struct: data pointer, dynamic shapes, dynamic strides (the unit
// stride left out; rank 1 has none, padding takes its place). Every variant's
// <name>_Tensor_<arg>_t of rank R has this layout; the conversion passes the struct as that
// type to the wrapper, which only forwards the pointer.
template <int R>
struct Tensor {
  void* data;
  int32_t shape[R];
  int32_t stride[R > 1 ? R - 1 : 1];
  template <typename T>
  operator T*() {
    static_assert(sizeof(T) == sizeof(Tensor), "exported tensor struct layout changed");
    return reinterpret_cast<T*>(this);
  }
};
inline int32_t I32(int64_t v) { return static_cast<int32_t>(v); }  // after Check: < 2^31
// Row-major [rows, cols] as the kernels see it: shape (rows, cols), stride cols (or
// `stride`: wgrad reads [M, K] as (K, M)); [d0, d1, d2] with strides (1, s1, s2).
inline Tensor<2> Matrix(void* data, int64_t rows, int64_t cols, int64_t stride = -1) {
  return {data, {I32(rows), I32(cols)}, {I32(stride < 0 ? cols : stride)}};
}
inline Tensor<1> Vector(void* data, int64_t n) { return {data, {I32(n)}, {0}}; }
inline Tensor<3> Batched(void* data, int64_t d0, int64_t d1, int64_t d2, int64_t s1, int64_t s2) {
  return {data, {I32(d0), I32(d1), I32(d2)}, {I32(s1), I32(s2)}};
}

// Every device's SM count (the persistent kernels' grid: one CTA per SM), read once, first
// at instantiate. 0 for an unknown device: the launch then fails.
inline int32_t SmCount(int32_t device) {
  static const std::vector<int32_t> counts = [] {
    int n = 0;
    std::vector<int32_t> c(cudaGetDeviceCount(&n) == cudaSuccess ? n : 0, 0);
    for (size_t d = 0; d < c.size(); ++d)
      cudaDeviceGetAttribute(&c[d], cudaDevAttrMultiProcessorCount, d);
    return c;
  }();
  return device >= 0 && device < static_cast<int32_t>(counts.size()) ? counts[device] : 0;
}

// The driver calls of LoadOnDevices, through the runtime's entry-point query (the extension
// links no libcuda). The query takes the base name; cuda.h may #define a name to its
// versioned symbol, hence the p_ fields.
#define JGM_DRIVER_CALLS(X)                                                                  \
  X(cuDeviceGet) X(cuDevicePrimaryCtxGetState) X(cuDevicePrimaryCtxRetain)                   \
  X(cuDevicePrimaryCtxRelease) X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuKernelGetFunction) \
  X(cuFuncLoad)
struct Driver {
#define JGM_FIELD(fn) decltype(&::fn) p_##fn = nullptr;
  JGM_DRIVER_CALLS(JGM_FIELD)
  bool ok = true;
  Driver() {
    cudaDriverEntryPointQueryResult q;
#define JGM_GET(fn)                                                                        \
  ok = ok && !cudaGetDriverEntryPointByVersion(#fn, reinterpret_cast<void**>(&p_##fn), 12040, \
                                               cudaEnableDefault, &q) &&                   \
       q == cudaDriverEntryPointSuccess;
    JGM_DRIVER_CALLS(JGM_GET)
  }
};

// Finishes loading `library`'s kernels on every device whose primary context is active (the
// devices jax uses; other GPUs get no context), as their first launch there would under
// CUDA's lazy loading. Returns an error message, empty on success. A driver without these
// calls (before CUDA 12.4) leaves the loading to the first launch.
inline std::string LoadOnDevices(cudaLibrary_t library) {
  static const Driver drv;
  unsigned int count = 0;
  int devices = 0;
  if (!drv.ok) return "";
  if (cudaLibraryGetKernelCount(&count, library) || cudaGetDeviceCount(&devices))
    return "no kernels";
  std::vector<cudaKernel_t> kernels(count);
  if (count && cudaLibraryEnumerateKernels(kernels.data(), count, library)) return "no kernels";
  for (int d = 0; d < devices; ++d) {
    CUdevice dev;
    CUcontext ctx;
    unsigned int flags = 0;
    int active = 0;
    if (drv.p_cuDeviceGet(&dev, d) || drv.p_cuDevicePrimaryCtxGetState(dev, &flags, &active) ||
        !active)
      continue;
    CUresult r = drv.p_cuDevicePrimaryCtxRetain(&ctx, dev);
    if (!r && !(r = drv.p_cuCtxPushCurrent(ctx))) {
      CUfunction f;
      for (cudaKernel_t k : kernels)
        if (!r && !(r = drv.p_cuKernelGetFunction(&f, reinterpret_cast<CUkernel>(k))))
          r = drv.p_cuFuncLoad(f);
      drv.p_cuCtxPopCurrent(&ctx);
    }
    drv.p_cuDevicePrimaryCtxRelease(dev);
    if (r) return "device " + std::to_string(d) + ": CUresult " + std::to_string(r);
  }
  return "";
}

// Internal naming the handler unless `err`, a launch or memset status, is cudaSuccess.
inline ffi::Error Status(const char* handler, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(handler) + ": launch failed: " + cudaGetErrorString(err));
}

// Clears results with async memsets (capturable); the first error.
template <typename... Buffers>
cudaError_t Zero(cudaStream_t stream, const Buffers&... bufs) {
  cudaError_t err = cudaSuccess;
  ((err = err || !bufs.size_bytes()
             ? err
             : cudaMemsetAsync(bufs.untyped_data(), 0, bufs.size_bytes(), stream)),
   ...);
  return err;
}

// Kernel launches recorded into a CUDA graph (XLA's command buffers) so far: the
// evidence tests read (_kernels.captured_launches()).
inline std::atomic<int64_t> g_captured_launches{0};

// One handler family: its compiled variants in `variant` attribute order, each module loaded
// once per process, and the one launch path. A variant's `launch` passes the family's Args
// to its cute_dsl_<name>_wrapper.
template <typename Args>
class Family {
 public:
  struct Variant {
    const char* name;
    const cudaLibrary_t* library;            // the exported module's, once loaded
    void (*load)();                          // <name>_Kernel_Module_Load on a static module
    int32_t (*launch)(Args&, cudaStream_t);  // returns a cudaError_t
  };
  Family(const char* name, std::vector<Variant> variants)
      : name_(name), variants_(std::move(variants)), once_(new std::once_flag[variants_.size()]),
        errors_(variants_.size()) {}

  // The instantiate stage (a no-op check at execute): loads the module of `variant` and its
  // kernels on the devices in use, once per process.
  ffi::Error Load(int32_t variant) {
    if (variant < 0 || variant >= static_cast<int32_t>(variants_.size()))
      return ffi::Error::InvalidArgument(std::string(name_) + ": attribute variant=" +
                                         std::to_string(variant) + " out of range [0, " +
                                         std::to_string(variants_.size()) + ")");
    const Variant& v = variants_[variant];
    std::string& error = errors_[variant];
    std::call_once(once_[variant], [&] {
      SmCount(0);  // read the SM counts now, outside any capture
      tls_load_error = cudaSuccess;
      v.load();
      error = tls_load_error ? cudaGetErrorString(tls_load_error) : LoadOnDevices(*v.library);
    });
    if (error.empty()) return ffi::Error::Success();
    return ffi::Error::Internal(std::string(name_) + ": loading " + v.name + " failed: " + error);
  }
  ffi::Error Launch(int32_t variant, Args& args, cudaStream_t stream) {
    if (auto e = Load(variant); e.failure()) return e;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;  // legal while capturing
    if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusActive)
      g_captured_launches.fetch_add(1, std::memory_order_relaxed);
    return Status(name_, static_cast<cudaError_t>(variants_[variant].launch(args, stream)));
  }

 private:
  const char* name_;
  std::vector<Variant> variants_;
  std::unique_ptr<std::once_flag[]> once_;
  std::vector<std::string> errors_;
};

}  // namespace jgm

// JGM_FAMILY(LIST, "name") declares a static module per variant of the generated list LIST
// (build/kernels/jgm_variants.h, from kernels/registry.py) and `kFamily`, whose variants'
// launch passes JGM_CALL(a, s) (Args `a` and stream `s` as the wrapper takes them).
#define JGM_VARIANT_NAME(name, ...) #name,
#define JGM_VARIANT_MODULE(name, ...) name##_Kernel_Module_t g_##name;
#define JGM_VARIANT_ROW(name, ...)                                        \
  {#name, &g_##name.module, [] { name##_Kernel_Module_Load(&g_##name); }, \
   [](Args& a, cudaStream_t s) { return cute_dsl_##name##_wrapper(&g_##name, JGM_CALL(a, s)); }},
#define JGM_FAMILY(LIST, name) \
  LIST(JGM_VARIANT_MODULE)     \
  Family<Args> kFamily(name, {LIST(JGM_VARIANT_ROW)});

// A family's handler symbols: <Sym>Instantiate (loads the variant's module), <Sym> (execute,
// command-buffer compatible) and <Sym>NoGraph (execute, not).
#define JGM_DEFINE_HANDLERS(Sym, family, execute, binding)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Sym##Instantiate, [](int32_t v) { return family.Load(v); }, \
                                xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant")); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Sym, execute, binding, {xla::ffi::Traits::kCmdBufferCompatible}); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Sym##NoGraph, execute, binding)
#define JGM_DECLARE_HANDLERS(Sym)                                                        \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Sym##Instantiate); XLA_FFI_DECLARE_HANDLER_SYMBOL(Sym); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Sym##NoGraph)
JGM_DECLARE_HANDLERS(JgmGroupedGemm);
JGM_DECLARE_HANDLERS(JgmGroupedGemmQw);
JGM_DECLARE_HANDLERS(JgmGroupedWgrad);
JGM_DECLARE_HANDLERS(JgmGroupedGemmFc1);
JGM_DECLARE_HANDLERS(JgmGroupedGemmDgrad);
JGM_DECLARE_HANDLERS(JgmFakeQuantize);
JGM_DECLARE_HANDLERS(JgmFakeQuantizePair);
JGM_DECLARE_HANDLERS(JgmDequantize);
JGM_DECLARE_HANDLERS(JgmGroupedGemmFp8Block);
JGM_DECLARE_HANDLERS(JgmGroupedGemmFp8BlockFc1);
JGM_DECLARE_HANDLERS(JgmQuantizeFp8BlockPair);
JGM_DECLARE_HANDLERS(JgmQuantizeFp8Block);
JGM_DECLARE_HANDLERS(JgmGroupedWgradFp8Block);
JGM_DECLARE_HANDLERS(JgmTokenMajorBlocks);
// layer_scan's host store (host_store.cc): host state, never in a CUDA graph.
namespace jgm {
// Pinned host memory the store holds: entries on a stack (a forward's copies waiting for
// their backward) and idle entries (kept for reuse by size).
struct HostStoreMemory {
  int64_t in_use_bytes = 0, in_use_entries = 0, idle_bytes = 0, idle_entries = 0;
};
HostStoreMemory HostStoreStats();
// Frees every idle entry once its last copies have finished; `released` gets the bytes.
cudaError_t HostStoreRelease(int64_t* released);
}  // namespace jgm
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmHostPutStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmHostPutDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmHostGetStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmHostGetDone);
// An unwritten result buffer (empty.cc): layer_scan's stacked gradients start from it.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JgmEmpty);
