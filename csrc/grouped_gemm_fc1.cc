// XLA FFI handler for the Hopper grouped GEMM with the FC1 epilogue
// (jax_grouped_mlp/kernels/grouped_gemm_fc1_sm90.py; Python side: _src/cuda/gemm_ffi.py).
// STATUS: GPU-tested on the H200 (tests/test_grouped_gemm_fc1_gpu.py).
//
//   h[m] = lhs[m] @ rhs[group(m)]  (bitwise what jgm_grouped_gemm writes), and from it
//   a = bf16(probs * relu(h)^2) as MXFP8: a_row (rowwise values in bf16), a_col (the
//   group-aware columnwise FP8 copy: E4M3 data + E8M0 scales).
//
// Operands and results (row-major, XLA's default layout):
//   lhs          bf16 [M, K]       K % 8 == 0
//   rhs          bf16 [G, K, N]    N % 8 == 0 (N contiguous; fprop only)
//   group_sizes  s32  [G]          read on the device only (clamped there)
//   probs        f32  [M]
//   h            bf16 [M, N]
//   a_row        bf16 [M, N]
//   a_col        f8e4m3fn (or u8) [M, N]
//   a_col_scale  f8e8m0fnu (or u8) [ceil(M / 32) + G, N]
// The scale output is cleared here (cudaMemsetAsync) before the launch: the kernel
// writes only the blocks of the groups, unused scale rows stay byte 0.
// Attribute: variant (int32): index into JGM_GROUPED_GEMM_FC1_VARIANTS (build/kernels/jgm_variants.h,
// generated from jax_grouped_mlp/kernels/registry.py).
// JGM_GROUPED_GEMM_FC1_VARIANTS(X), X(name): generated from the registry.
#include "jgm_variants.h"

namespace jgm {

const char* const kGroupedGemmFc1Variants[] = {JGM_GROUPED_GEMM_FC1_VARIANTS(JGM_VARIANT_NAME)};
const int kNumGroupedGemmFc1Variants =
    sizeof(kGroupedGemmFc1Variants) / sizeof(kGroupedGemmFc1Variants[0]);

namespace {

constexpr const char* kName = "grouped_gemm_fc1";
constexpr int64_t kBlock = 32;

JGM_GROUPED_GEMM_FC1_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_GROUPED_GEMM_FC1_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumGroupedGemmFc1Variants);
}

bool IsByte(ffi::DataType t, ffi::DataType fp8) { return t == fp8 || t == ffi::U8; }

ffi::Error Validate(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                    ffi::AnyBuffer probs, ffi::Result<ffi::AnyBuffer>& h,
                    ffi::Result<ffi::AnyBuffer>& a_row,
                    ffi::Result<ffi::AnyBuffer>& a_col,
                    ffi::Result<ffi::AnyBuffer>& a_col_scale, int64_t* m, int64_t* n,
                    int64_t* k, int64_t* g, int64_t* nb) {
  const std::string pre = std::string(kName) + ": ";
  if (lhs.element_type() != ffi::BF16 || lhs.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "lhs must be a bf16 [M, K] array, got shape " +
                                       DimsToString(lhs.dimensions()));
  if (rhs.element_type() != ffi::BF16 || rhs.dimensions().size() != 3)
    return ffi::Error::InvalidArgument(pre + "rhs must be a bf16 [G, K, N] array, got shape " +
                                       DimsToString(rhs.dimensions()));
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  *m = lhs.dimensions()[0];
  *k = lhs.dimensions()[1];
  *g = rhs.dimensions()[0];
  *n = rhs.dimensions()[2];
  *nb = CeilDiv(*m, kBlock) + *g;
  if (rhs.dimensions()[1] != *k)
    return ffi::Error::InvalidArgument(pre + "rhs " + DimsToString(rhs.dimensions()) +
                                       " does not match lhs " + DimsToString(lhs.dimensions()) +
                                       " in K");
  if (group_sizes.dimensions()[0] != *g)
    return ffi::Error::InvalidArgument(pre + "group_sizes has " +
                                       std::to_string(group_sizes.dimensions()[0]) +
                                       " entries but rhs has G=" + std::to_string(*g));
  if (probs.element_type() != ffi::F32 || probs.dimensions().size() != 1 ||
      probs.dimensions()[0] != *m)
    return ffi::Error::InvalidArgument(pre + "probs must be a float32 [M] array with M=" +
                                       std::to_string(*m) + ", got shape " +
                                       DimsToString(probs.dimensions()));
  if (*k % 8 != 0 || *n % 8 != 0)
    return ffi::Error::InvalidArgument(pre + "K=" + std::to_string(*k) + " and N=" +
                                       std::to_string(*n) +
                                       " must be multiples of 8 (16-byte TMA strides)");
  constexpr int64_t kMax = int64_t{1} << 31;
  if (*m * *k >= kMax || *m * *n >= kMax || *g * *k * *n >= kMax || *nb * *n >= kMax)
    return ffi::Error::InvalidArgument(pre + "operands must have < 2^31 elements each (32-bit "
                                       "offsets), got M=" + std::to_string(*m) + " N=" +
                                       std::to_string(*n) + " K=" + std::to_string(*k) +
                                       " G=" + std::to_string(*g));
  if (auto e = CheckBuffer("grouped_gemm_fc1: h", *h, ffi::BF16, {*m, *n}); e.failure()) return e;
  if (auto e = CheckBuffer("grouped_gemm_fc1: a_row", *a_row, ffi::BF16, {*m, *n}); e.failure())
    return e;
  if (!IsByte(a_col->element_type(), ffi::F8E4M3FN))
    return ffi::Error::InvalidArgument(pre + "a_col must be float8_e4m3fn (or uint8)");
  if (auto e = CheckBuffer("grouped_gemm_fc1: a_col", *a_col, a_col->element_type(), {*m, *n});
      e.failure())
    return e;
  if (!IsByte(a_col_scale->element_type(), ffi::F8E8M0FNU))
    return ffi::Error::InvalidArgument(pre + "a_col_scale must be float8_e8m0fnu (or uint8)");
  return CheckBuffer("grouped_gemm_fc1: a_col_scale", *a_col_scale, a_col_scale->element_type(),
                     {*nb, *n});
}

ffi::Error GroupedGemmFc1Instantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error GroupedGemmFc1(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                          ffi::AnyBuffer group_sizes, ffi::AnyBuffer probs,
                          ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> a_row,
                          ffi::Result<ffi::AnyBuffer> a_col,
                          ffi::Result<ffi::AnyBuffer> a_col_scale, int32_t variant) {
  int64_t m = 0, n = 0, k = 0, g = 0, nb = 0;
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  if (auto e = Validate(lhs, rhs, group_sizes, probs, h, a_row, a_col, a_col_scale, &m, &n, &k,
                        &g, &nb);
      e.failure())
    return e;
  // Unused scale rows are byte 0; the kernel writes only the groups' blocks.
  if (a_col_scale->size_bytes() > 0) {
    cudaError_t err = cudaMemsetAsync(a_col_scale->untyped_data(), 0, a_col_scale->size_bytes(),
                                      stream);
    if (err != cudaSuccess) return LaunchResult(kName, static_cast<int32_t>(err));
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (g == 0 || k == 0) {
    // No launch (a TMA descriptor cannot have an empty dimension): zeros. The Python
    // binding never gets here (it computes these static cases exactly in JAX); here
    // a_row is +0 where the exact result is bf16(probs * 0) (-0, or NaN for non-finite probs).
    for (auto* buf : {&h, &a_row, &a_col}) {
      cudaError_t err = cudaMemsetAsync((*buf)->untyped_data(), 0, (*buf)->size_bytes(), stream);
      if (err != cudaSuccess) return LaunchResult(kName, static_cast<int32_t>(err));
    }
    return ffi::Error::Success();
  }
  int32_t num_sms = 0;
  if (auto e = NumSms(kName, stream, &num_sms); e.failure()) return e;
  const int32_t mi = static_cast<int32_t>(m), ni = static_cast<int32_t>(n),
                ki = static_cast<int32_t>(k), gi = static_cast<int32_t>(g),
                nbi = static_cast<int32_t>(nb);
  int32_t ret = 0;
  int32_t i = 0;
  // Exported tensor structs: data pointer, dynamic shapes, dynamic strides (the static
  // unit stride left out). rhs is seen as (N, K, G) with strides (1, N, K * N).
#define JGM_LAUNCH(name)                                                                 \
  if (variant == i++) {                                                                  \
    name##_Tensor_a_t ta = {lhs.untyped_data(), {mi, ki}, {ki}};                         \
    name##_Tensor_b_t tb = {rhs.untyped_data(), {ni, ki, gi}, {ni, ki * ni}};            \
    name##_Tensor_out_t th = {h->untyped_data(), {mi, ni}, {ni}};                        \
    name##_Tensor_a_row_t tr = {a_row->untyped_data(), {mi, ni}, {ni}};                  \
    name##_Tensor_a_col_t tc = {a_col->untyped_data(), {mi, ni}, {ni}};                  \
    name##_Tensor_a_scale_t ts = {a_col_scale->untyped_data(), {nbi, ni}, {ni}};         \
    name##_Tensor_probs_t tp = {probs.untyped_data(), {mi}};                             \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};                 \
    ret = cute_dsl_##name##_wrapper(&g_##name, &ta, &tb, &th, &tr, &tc, &ts, &tp, &tg,   \
                                    num_sms, stream);                                    \
  }
  JGM_GROUPED_GEMM_FC1_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmFc1Instantiate, jgm::GroupedGemmFc1Instantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation (group_sizes stay on the device); module loaded at instantiate.
// Not kCmdBufferCompatible, for the reason given in grouped_gemm.cc.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JgmGroupedGemmFc1, jgm::GroupedGemmFc1,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()  // lhs          bf16 [M, K]
        .Arg<xla::ffi::AnyBuffer>()  // rhs          bf16 [G, K, N]
        .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
        .Arg<xla::ffi::AnyBuffer>()  // probs        f32 [M]
        .Ret<xla::ffi::AnyBuffer>()  // h            bf16 [M, N]
        .Ret<xla::ffi::AnyBuffer>()  // a_row        bf16 [M, N]
        .Ret<xla::ffi::AnyBuffer>()  // a_col        f8e4m3fn [M, N]
        .Ret<xla::ffi::AnyBuffer>()  // a_col_scale  f8e8m0fnu [ceil(M/32) + G, N]
        .Attr<int32_t>("variant"));
