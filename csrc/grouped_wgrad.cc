// XLA FFI handler for the Hopper grouped weight gradient over ragged M
// (jax_grouped_mlp/kernels/grouped_wgrad_sm90.py; Python side: _src/cuda/gemm_ffi.py).
//
//   out[g] = lhs_g^T @ rhs_g over group g's rows; empty groups give zeros.
//
// Operands and result (row-major, XLA's default layout):
//   lhs          bf16 [M, K]       K % 8 == 0 (the kernel reads it as (K, M))
//   rhs          bf16 [M, N]       N % 8 == 0 (the kernel reads it as (N, M))
//   group_sizes  s32  [G]          read on the device only (clamped there)
//   out          bf16 or f32 [G, K, N]   (the variant's output type)
// Attribute: variant (int32): index into JGM_GROUPED_WGRAD_VARIANTS (build/kernels/
// jgm_variants.h, generated from jax_grouped_mlp/kernels/registry.py).
// JGM_GROUPED_WGRAD_VARIANTS(X), X(name, output element type): generated from the registry.
#include "jgm_variants.h"

namespace jgm {

const char* const kGroupedWgradVariants[] = {JGM_GROUPED_WGRAD_VARIANTS(JGM_VARIANT_NAME)};
const int kNumGroupedWgradVariants =
    sizeof(kGroupedWgradVariants) / sizeof(kGroupedWgradVariants[0]);

namespace {

constexpr const char* kName = "grouped_wgrad";

JGM_GROUPED_WGRAD_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_GROUPED_WGRAD_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumGroupedWgradVariants);
}

ffi::DataType OutType(int32_t variant) {
  const ffi::DataType types[] = {
#define JGM_TYPE(name, dtype) dtype,
      JGM_GROUPED_WGRAD_VARIANTS(JGM_TYPE)
#undef JGM_TYPE
  };
  return types[variant];  // variant checked by LoadModule first
}

ffi::Error Validate(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                    ffi::Result<ffi::AnyBuffer>& out, ffi::DataType out_type,
                    int64_t* m, int64_t* n, int64_t* k, int64_t* g) {
  const std::string pre = std::string(kName) + ": ";
  if (lhs.element_type() != ffi::BF16 || lhs.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "lhs must be a bf16 [M, K] array, got shape " +
                                       DimsToString(lhs.dimensions()));
  if (rhs.element_type() != ffi::BF16 || rhs.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "rhs must be a bf16 [M, N] array, got shape " +
                                       DimsToString(rhs.dimensions()));
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  *m = lhs.dimensions()[0];
  *k = lhs.dimensions()[1];
  *n = rhs.dimensions()[1];
  *g = group_sizes.dimensions()[0];
  if (rhs.dimensions()[0] != *m)
    return ffi::Error::InvalidArgument(pre + "rhs " + DimsToString(rhs.dimensions()) +
                                       " does not match lhs " + DimsToString(lhs.dimensions()) +
                                       " in M");
  if (*k % 8 != 0 || *n % 8 != 0)
    return ffi::Error::InvalidArgument(pre + "K=" + std::to_string(*k) + " and N=" +
                                       std::to_string(*n) +
                                       " must be multiples of 8 (16-byte TMA strides)");
  constexpr int64_t kMax = int64_t{1} << 31;
  if (*m * *k >= kMax || *m * *n >= kMax || *g * *k * *n >= kMax)
    return ffi::Error::InvalidArgument(pre + "operands must have < 2^31 elements each (32-bit "
                                       "offsets), got M=" + std::to_string(*m) + " N=" +
                                       std::to_string(*n) + " K=" + std::to_string(*k) +
                                       " G=" + std::to_string(*g));
  return CheckBuffer("grouped_wgrad: out", *out, out_type, {*g, *k, *n});
}

ffi::Error GroupedWgradInstantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error GroupedWgrad(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                        ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> out,
                        int32_t variant) {
  int64_t m = 0, n = 0, k = 0, g = 0;
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  if (auto e = Validate(lhs, rhs, group_sizes, out, OutType(variant), &m, &n, &k, &g);
      e.failure())
    return e;
  if (g == 0 || k == 0 || n == 0) return ffi::Error::Success();  // empty result
  if (m == 0) {
    // No rows: every gradient is zero. (A TMA descriptor cannot have an empty dimension.)
    cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return LaunchResult(kName, static_cast<int32_t>(err));
  }
  int32_t num_sms = 0;
  if (auto e = NumSms(kName, stream, &num_sms); e.failure()) return e;
  const int32_t mi = static_cast<int32_t>(m), ni = static_cast<int32_t>(n),
                ki = static_cast<int32_t>(k), gi = static_cast<int32_t>(g);
  int32_t ret = 0;
  int32_t i = 0;
  // Exported tensor structs: data pointer, dynamic shapes, dynamic strides.
  // lhs as (K, M) strides (1, K); rhs as (N, M) strides (1, N); out as (K, N, G)
  // strides (N, 1, K * N).
#define JGM_LAUNCH(name, dtype)                                                     \
  if (variant == i++) {                                                             \
    name##_Tensor_a_t ta = {lhs.untyped_data(), {ki, mi}, {ki}};                    \
    name##_Tensor_b_t tb = {rhs.untyped_data(), {ni, mi}, {ni}};                    \
    name##_Tensor_out_t to = {out->untyped_data(), {ki, ni, gi}, {ni, ki * ni}};    \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};            \
    ret = cute_dsl_##name##_wrapper(&g_##name, &ta, &tb, &to, &tg, num_sms, stream); \
  }
  JGM_GROUPED_WGRAD_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedWgradInstantiate, jgm::GroupedWgradInstantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation; not kCmdBufferCompatible for the reason in grouped_gemm.cc.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JgmGroupedWgrad, jgm::GroupedWgrad,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()  // lhs          bf16 [M, K]
        .Arg<xla::ffi::AnyBuffer>()  // rhs          bf16 [M, N]
        .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
        .Ret<xla::ffi::AnyBuffer>()  // out          bf16 or f32 [G, K, N]
        .Attr<int32_t>("variant"));
