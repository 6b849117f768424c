// XLA FFI handler for the MXFP8 fake-quantize kernel
// (jax_grouped_mlp/kernels/fake_quantize_mxfp8.py; Python side: _src/ffi.py).
//
//   out = the MXFP8 values of x, in bf16: rowwise (32-blocks along K) or group-aware
//   columnwise (32-row blocks along M), by variant.
//
// Operands and result (row-major):
//   x            bf16 [M, K]    K % 8 == 0, M * K < 2^31
//   group_sizes  s32  [G]       read on the device only
//   out          bf16 [M, K]
// Attribute: variant (int32): index into JGM_FAKE_QUANTIZE_VARIANTS (the same list as
// jax_grouped_mlp/kernels/aot.py's _fake_quantize_variants).
#include "kernels.h"  // first: it defines CUTE_DSL_CUDA_ERROR_CHECK for the headers below
#include "fake_quantize_mxfp8_col_v8_t128.h"
#include "fake_quantize_mxfp8_row_v8_t128.h"

#define JGM_FAKE_QUANTIZE_VARIANTS(X) \
  X(fake_quantize_mxfp8_row_v8_t128)  \
  X(fake_quantize_mxfp8_col_v8_t128)

namespace jgm {

const char* const kFakeQuantizeVariants[] = {JGM_FAKE_QUANTIZE_VARIANTS(JGM_VARIANT_NAME)};
const int kNumFakeQuantizeVariants =
    sizeof(kFakeQuantizeVariants) / sizeof(kFakeQuantizeVariants[0]);

namespace {

constexpr const char* kName = "fake_quantize_mxfp8";

JGM_FAKE_QUANTIZE_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_FAKE_QUANTIZE_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumFakeQuantizeVariants);
}

ffi::Error Validate(ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                    const ffi::Result<ffi::AnyBuffer>& out, int64_t* m, int64_t* k, int64_t* g) {
  const std::string pre = std::string(kName) + ": ";
  if (x.element_type() != ffi::BF16 || x.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "x must be a bf16 [M, K] array, got shape " +
                                       DimsToString(x.dimensions()));
  *m = x.dimensions()[0];
  *k = x.dimensions()[1];
  if (*k % 8 != 0)
    return ffi::Error::InvalidArgument(pre + "x has K=" + std::to_string(*k) +
                                       ", which must be a multiple of 8");
  if (*m * *k >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument(pre + "x has M*K=" + std::to_string(*m * *k) +
                                       " elements; the kernel uses 32-bit offsets (< 2^31)");
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  *g = group_sizes.dimensions()[0];
  return CheckBuffer("fake_quantize_mxfp8: out", *out, ffi::BF16, {*m, *k});
}

ffi::Error FakeQuantizeInstantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error FakeQuantize(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                        ffi::Result<ffi::AnyBuffer> out, int32_t variant) {
  int64_t m = 0, k = 0, g = 0;
  if (auto e = Validate(x, group_sizes, out, &m, &k, &g); e.failure()) return e;
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  if (m == 0 || k == 0) return ffi::Error::Success();  // nothing to write
  const int32_t mi = static_cast<int32_t>(m), ki = static_cast<int32_t>(k),
                gi = static_cast<int32_t>(g);
  int32_t ret = 0;
  int32_t i = 0;
#define JGM_LAUNCH(name)                                                       \
  if (variant == i++) {                                                        \
    name##_Tensor_x_t tx = {x.untyped_data(), {mi, ki}, {ki}};                 \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};       \
    name##_Tensor_out_t tout = {out->untyped_data(), {mi, ki}, {ki}};          \
    ret = cute_dsl_##name##_wrapper(&g_##name, &tx, &tg, &tout, stream);       \
  }
  JGM_FAKE_QUANTIZE_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmFakeQuantizeInstantiate, jgm::FakeQuantizeInstantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation; not kCmdBufferCompatible for the reason in grouped_gemm.cc.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmFakeQuantize, jgm::FakeQuantize,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x            bf16 [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
                                  .Ret<xla::ffi::AnyBuffer>()  // out          bf16 [M, K]
                                  .Attr<int32_t>("variant"));
