// XLA FFI handler for the Hopper grouped GEMM over ragged M
// (jax_grouped_mlp/kernels/grouped_gemm_sm90.py; Python side: _src/cuda/gemm_ffi.py).
//
//   out[m] = lhs[m] @ rhs[group(m)], rows at or past sum(group_sizes) are zero.
//
// Operands and result (row-major, XLA's default layout):
//   lhs          bf16 [M, K]       K % 8 == 0
//   rhs          bf16 [G, K, N]    N % 8 == 0 (the kernel reads it N-contiguous), or
//                bf16 [G, N, K]    for the rhs_k_major ("_bk") variants (a transposed weight as stored)
//   group_sizes  s32  [G]          read on the device only (clamped there)
//   out          bf16 [M, N]
// Attribute: variant (int32): index into JGM_GROUPED_GEMM_VARIANTS (the compiled tile
// configurations: build/kernels/jgm_variants.h, generated from jax_grouped_mlp/kernels/registry.py).
// JGM_GROUPED_GEMM_VARIANTS(X), X(name, rhs_k_major): generated from the registry. The
// "_qw" variants (kernels/grouped_gemm_qw_sm90.py) take the same operands but multiply by
// the MXFP8 values of rhs (quantized along K in the kernel), not rhs itself.
#include "jgm_variants.h"

namespace jgm {

const char* const kGroupedGemmVariants[] = {JGM_GROUPED_GEMM_VARIANTS(JGM_VARIANT_NAME)};
const int kNumGroupedGemmVariants =
    sizeof(kGroupedGemmVariants) / sizeof(kGroupedGemmVariants[0]);

namespace {

constexpr const char* kName = "grouped_gemm";

JGM_GROUPED_GEMM_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_GROUPED_GEMM_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumGroupedGemmVariants);
}

// Whether variant `variant` (already range-checked) reads rhs as [G, N, K].
bool RhsKMajor(int32_t variant) {
  const bool k_major[] = {
#define JGM_BK(name, bk) bk,
      JGM_GROUPED_GEMM_VARIANTS(JGM_BK)
#undef JGM_BK
  };
  return k_major[variant];
}

ffi::Error Validate(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                    ffi::Result<ffi::AnyBuffer>& out, bool rhs_k_major, int64_t* m,
                    int64_t* n, int64_t* k, int64_t* g) {
  const std::string pre = std::string(kName) + ": ";
  if (lhs.element_type() != ffi::BF16 || lhs.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "lhs must be a bf16 [M, K] array, got shape " +
                                       DimsToString(lhs.dimensions()));
  if (rhs.element_type() != ffi::BF16 || rhs.dimensions().size() != 3)
    return ffi::Error::InvalidArgument(pre + "rhs must be a bf16 " +
                                       (rhs_k_major ? "[G, N, K]" : "[G, K, N]") +
                                       " array, got shape " + DimsToString(rhs.dimensions()));
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  *m = lhs.dimensions()[0];
  *k = lhs.dimensions()[1];
  *g = rhs.dimensions()[0];
  *n = rhs.dimensions()[rhs_k_major ? 1 : 2];
  if (rhs.dimensions()[rhs_k_major ? 2 : 1] != *k)
    return ffi::Error::InvalidArgument(pre + "rhs " + DimsToString(rhs.dimensions()) +
                                       " does not match lhs " + DimsToString(lhs.dimensions()) +
                                       " in K");
  if (group_sizes.dimensions()[0] != *g)
    return ffi::Error::InvalidArgument(pre + "group_sizes has " +
                                       std::to_string(group_sizes.dimensions()[0]) +
                                       " entries but rhs has G=" + std::to_string(*g));
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
  return CheckBuffer("grouped_gemm: out", *out, ffi::BF16, {*m, *n});
}

ffi::Error GroupedGemmInstantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error GroupedGemm(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                       ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> out,
                       int32_t variant) {
  int64_t m = 0, n = 0, k = 0, g = 0;
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  const bool k_major = RhsKMajor(variant);
  if (auto e = Validate(lhs, rhs, group_sizes, out, k_major, &m, &n, &k, &g); e.failure())
    return e;
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (g == 0 || k == 0) {
    // Every row is past the groups (G = 0) or every product is empty (K = 0).
    // A TMA descriptor cannot have an empty dimension, so no launch.
    cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return LaunchResult(kName, static_cast<int32_t>(err));
  }
  int32_t num_sms = 0;
  if (auto e = NumSms(kName, stream, &num_sms); e.failure()) return e;
  const int32_t mi = static_cast<int32_t>(m), ni = static_cast<int32_t>(n),
                ki = static_cast<int32_t>(k), gi = static_cast<int32_t>(g);
  int32_t ret = 0;
  int32_t i = 0;
  // Exported tensor structs: data pointer, dynamic shapes, dynamic strides (the
  // static unit stride left out). rhs is seen as (N, K, G) with strides (1, N, K * N),
  // or (K, 1, N * K) for the K-major variants.
  const int32_t rhs_dyn_stride = k_major ? ki : ni;  // N's stride (K-major) or K's
#define JGM_LAUNCH(name, bk)                                                        \
  if (variant == i++) {                                                             \
    name##_Tensor_a_t ta = {lhs.untyped_data(), {mi, ki}, {ki}};                    \
    name##_Tensor_b_t tb = {rhs.untyped_data(), {ni, ki, gi}, {rhs_dyn_stride, ki * ni}}; \
    name##_Tensor_out_t to = {out->untyped_data(), {mi, ni}, {ni}};                 \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};            \
    ret = cute_dsl_##name##_wrapper(&g_##name, &ta, &tb, &to, &tg, num_sms, stream); \
  }
  JGM_GROUPED_GEMM_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmInstantiate, jgm::GroupedGemmInstantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation (group_sizes stay on the device); module loaded at instantiate.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JgmGroupedGemm, jgm::GroupedGemm,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()  // lhs          bf16 [M, K]
        .Arg<xla::ffi::AnyBuffer>()  // rhs          bf16 [G, K, N]
        .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
        .Ret<xla::ffi::AnyBuffer>()  // out          bf16 [M, N]
        .Attr<int32_t>("variant"));
// Not marked kCmdBufferCompatible: on the H200 the exported DSL launch wrapper failed
// inside XLA's CUDA-graph capture ("operation not permitted when stream is capturing"),
// so XLA must run these custom calls outside command buffers until that is fixed.
