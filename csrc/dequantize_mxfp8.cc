// XLA FFI handler for the group-aware columnwise MXFP8 dequantize kernel
// (jax_grouped_mlp/kernels/dequantize_mxfp8.py; Python side: _src/cuda/ffi.py).
//
//   out = dequantize(MXFP8Tensor(data, scale, axis=0, group_sizes)) in bf16; rows past
//   sum(group_sizes) are zero.
//
// Operands and result (row-major):
//   data         f8e4m3fn  [M, K]              K % 8 == 0, M * K < 2^31
//   scale        f8e8m0fnu [cdiv(M, 32) + G, K]
//   group_sizes  s32       [G]                 read on the device only
//   out          bf16      [M, K]
// Attribute: variant (int32): index into JGM_DEQUANTIZE_VARIANTS (build/kernels/jgm_variants.h,
// generated from jax_grouped_mlp/kernels/registry.py).
// JGM_DEQUANTIZE_VARIANTS(X), X(name): generated from the registry.
#include "jgm_variants.h"

#include <algorithm>

namespace jgm {

const char* const kDequantizeVariants[] = {JGM_DEQUANTIZE_VARIANTS(JGM_VARIANT_NAME)};
const int kNumDequantizeVariants = sizeof(kDequantizeVariants) / sizeof(kDequantizeVariants[0]);

namespace {

constexpr const char* kName = "dequantize_mxfp8";

JGM_DEQUANTIZE_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_DEQUANTIZE_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumDequantizeVariants);
}

ffi::Error Validate(ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::AnyBuffer group_sizes,
                    ffi::Result<ffi::AnyBuffer>& out, int64_t* m, int64_t* k, int64_t* g) {
  const std::string pre = std::string(kName) + ": ";
  if (data.element_type() != ffi::F8E4M3FN || data.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "data must be an f8e4m3fn [M, K] array, got shape " +
                                       DimsToString(data.dimensions()));
  *m = data.dimensions()[0];
  *k = data.dimensions()[1];
  if (*k % 8 != 0)
    return ffi::Error::InvalidArgument(pre + "data has K=" + std::to_string(*k) +
                                       ", which must be a multiple of 8");
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  *g = group_sizes.dimensions()[0];
  const int64_t nb = CeilDiv(*m, 32) + *g;
  if (std::max(*m, nb) * *k >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument(pre + "M*K and (cdiv(M, 32) + G)*K must be < 2^31 (32-bit offsets)");
  if (auto e = CheckBuffer("dequantize_mxfp8: scale", scale, ffi::F8E8M0FNU, {nb, *k}); e.failure())
    return e;
  return CheckBuffer("dequantize_mxfp8: out", *out, ffi::BF16, {*m, *k});
}

ffi::Error DequantizeInstantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error Dequantize(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                      ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> out,
                      int32_t variant) {
  int64_t m = 0, k = 0, g = 0;
  if (auto e = Validate(data, scale, group_sizes, out, &m, &k, &g); e.failure()) return e;
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  if (m == 0 || k == 0) return ffi::Error::Success();  // nothing to write
  const int32_t mi = static_cast<int32_t>(m), ki = static_cast<int32_t>(k),
                gi = static_cast<int32_t>(g), nbi = static_cast<int32_t>(CeilDiv(m, 32) + g);
  int32_t ret = 0;
  int32_t i = 0;
#define JGM_LAUNCH(name)                                                          \
  if (variant == i++) {                                                           \
    name##_Tensor_data_t td = {data.untyped_data(), {mi, ki}, {ki}};              \
    name##_Tensor_scale_t ts = {scale.untyped_data(), {nbi, ki}, {ki}};           \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};          \
    name##_Tensor_out_t tout = {out->untyped_data(), {mi, ki}, {ki}};             \
    ret = cute_dsl_##name##_wrapper(&g_##name, &td, &ts, &tg, &tout, stream);     \
  }
  JGM_DEQUANTIZE_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmDequantizeInstantiate, jgm::DequantizeInstantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation; not kCmdBufferCompatible for the reason in grouped_gemm.cc.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmDequantize, jgm::Dequantize,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // data         e4m3 [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()  // scale        e8m0 [NB, K]
                                  .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
                                  .Ret<xla::ffi::AnyBuffer>()  // out          bf16 [M, K]
                                  .Attr<int32_t>("variant"));
