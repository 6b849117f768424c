// XLA FFI handler for the Hopper grouped GEMM with MXFP8 weights converted in the kernel
// (jax_grouped_mlp/kernels/grouped_gemm_w8_sm90.py; Python side: _src/cuda/gemm_ffi.py).
//
//   out[m] = lhs[m] @ dequantize(rhs, rhs_scale)[group(m)], rows at or past
//   sum(group_sizes) are zero; bitwise equal to jgm_grouped_gemm on dequantize(rhs).
//
// Operands and result (row-major, XLA's default layout):
//   lhs          bf16 [M, K]              K % 16 == 0
//   rhs          f8e4m3fn (or u8) [G, K, N]   N % 16 == 0 (N contiguous), or
//                f8e4m3fn (or u8) [G, N, K]   for the "_bk" variants (K contiguous)
//   rhs_scale    f8e8m0fnu (or u8) [G, ceil(K / 32), N]  E8M0, N contiguous, for both
//                layouts (one byte per 32 consecutive K of one column)
//   group_sizes  s32  [G]                 read on the device only (clamped there)
//   out          bf16 [M, N]
// N and K multiples of 16: the byte tensors' TMA row strides must be 16-byte multiples.
// Attribute: variant (int32): index into JGM_GROUPED_GEMM_W8_VARIANTS (the same list as
// jax_grouped_mlp/kernels/aot.py's _grouped_gemm_w8_variants).
#include "kernels.h"  // first: it defines CUTE_DSL_CUDA_ERROR_CHECK for the headers below
#include "grouped_gemm_sm90_w8_m128n192k64_s4.h"
#include "grouped_gemm_sm90_w8_m128n192k64_s4_bk.h"
#include "grouped_gemm_sm90_w8_m128n192k64_s4_c7.h"
#include "grouped_gemm_sm90_w8_m128n192k64_s4_c7_bk.h"
#include "grouped_gemm_sm90_w8_m128n256k64_s3.h"
#include "grouped_gemm_sm90_w8_m128n256k64_s3_bk.h"

// X(name, b_k_major): every exported variant, in the order of the `variant` attribute.
#define JGM_GROUPED_GEMM_W8_VARIANTS(X)            \
  X(grouped_gemm_sm90_w8_m128n256k64_s3, false)    \
  X(grouped_gemm_sm90_w8_m128n192k64_s4, false)    \
  X(grouped_gemm_sm90_w8_m128n256k64_s3_bk, true)  \
  X(grouped_gemm_sm90_w8_m128n192k64_s4_bk, true)  \
  X(grouped_gemm_sm90_w8_m128n192k64_s4_c7, false) \
  X(grouped_gemm_sm90_w8_m128n192k64_s4_c7_bk, true)

namespace jgm {

const char* const kGroupedGemmW8Variants[] = {JGM_GROUPED_GEMM_W8_VARIANTS(JGM_VARIANT_NAME)};
const int kNumGroupedGemmW8Variants =
    sizeof(kGroupedGemmW8Variants) / sizeof(kGroupedGemmW8Variants[0]);

namespace {

constexpr const char* kName = "grouped_gemm_w8";
constexpr int64_t kScaleBlock = 32;

JGM_GROUPED_GEMM_W8_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_GROUPED_GEMM_W8_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumGroupedGemmW8Variants);
}

// Whether variant `variant` (already range-checked) reads rhs as [G, N, K].
bool RhsKMajor(int32_t variant) {
  const bool k_major[] = {
#define JGM_BK(name, bk) bk,
      JGM_GROUPED_GEMM_W8_VARIANTS(JGM_BK)
#undef JGM_BK
  };
  return k_major[variant];
}

bool IsByte(ffi::DataType t, ffi::DataType fp8) { return t == fp8 || t == ffi::U8; }

ffi::Error Validate(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer rhs_scale,
                    ffi::AnyBuffer group_sizes, const ffi::Result<ffi::AnyBuffer>& out,
                    bool rhs_k_major, int64_t* m, int64_t* n, int64_t* k, int64_t* g,
                    int64_t* kb) {
  const std::string pre = std::string(kName) + ": ";
  if (lhs.element_type() != ffi::BF16 || lhs.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "lhs must be a bf16 [M, K] array, got shape " +
                                       DimsToString(lhs.dimensions()));
  if (!IsByte(rhs.element_type(), ffi::F8E4M3FN) || rhs.dimensions().size() != 3)
    return ffi::Error::InvalidArgument(pre + "rhs must be a float8_e4m3fn (or uint8) " +
                                       (rhs_k_major ? "[G, N, K]" : "[G, K, N]") +
                                       " array, got shape " + DimsToString(rhs.dimensions()) +
                                       " and data type enum " +
                                       std::to_string(static_cast<int>(rhs.element_type())));
  if (!IsByte(rhs_scale.element_type(), ffi::F8E8M0FNU) || rhs_scale.dimensions().size() != 3)
    return ffi::Error::InvalidArgument(
        pre + "rhs_scale must be a float8_e8m0fnu (or uint8) [G, ceil(K/32), N] array, got shape " +
        DimsToString(rhs_scale.dimensions()) + " and data type enum " +
        std::to_string(static_cast<int>(rhs_scale.element_type())));
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  *m = lhs.dimensions()[0];
  *k = lhs.dimensions()[1];
  *g = rhs.dimensions()[0];
  *n = rhs.dimensions()[rhs_k_major ? 1 : 2];
  *kb = CeilDiv(*k, kScaleBlock);
  if (rhs.dimensions()[rhs_k_major ? 2 : 1] != *k)
    return ffi::Error::InvalidArgument(pre + "rhs " + DimsToString(rhs.dimensions()) +
                                       " does not match lhs " + DimsToString(lhs.dimensions()) +
                                       " in K");
  auto sd = rhs_scale.dimensions();
  if (sd[0] != *g || sd[1] != *kb || sd[2] != *n)
    return ffi::Error::InvalidArgument(pre + "rhs_scale has shape " + DimsToString(sd) +
                                       ", expected [" + std::to_string(*g) + ", " +
                                       std::to_string(*kb) + ", " + std::to_string(*n) +
                                       "] ([G, ceil(K/32), N])");
  if (group_sizes.dimensions()[0] != *g)
    return ffi::Error::InvalidArgument(pre + "group_sizes has " +
                                       std::to_string(group_sizes.dimensions()[0]) +
                                       " entries but rhs has G=" + std::to_string(*g));
  if (*k % 16 != 0 || *n % 16 != 0)
    return ffi::Error::InvalidArgument(pre + "K=" + std::to_string(*k) + " and N=" +
                                       std::to_string(*n) +
                                       " must be multiples of 16 (16-byte TMA strides of the "
                                       "FP8 and scale arrays)");
  constexpr int64_t kMax = int64_t{1} << 31;
  if (*m * *k >= kMax || *m * *n >= kMax || *g * *k * *n >= kMax)
    return ffi::Error::InvalidArgument(pre + "operands must have < 2^31 elements each (32-bit "
                                       "offsets), got M=" + std::to_string(*m) + " N=" +
                                       std::to_string(*n) + " K=" + std::to_string(*k) +
                                       " G=" + std::to_string(*g));
  return CheckBuffer("grouped_gemm_w8: out", *out, ffi::BF16, {*m, *n});
}

ffi::Error GroupedGemmW8Instantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error GroupedGemmW8(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::AnyBuffer rhs_scale, ffi::AnyBuffer group_sizes,
                         ffi::Result<ffi::AnyBuffer> out, int32_t variant) {
  int64_t m = 0, n = 0, k = 0, g = 0, kb = 0;
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  const bool k_major = RhsKMajor(variant);
  if (auto e = Validate(lhs, rhs, rhs_scale, group_sizes, out, k_major, &m, &n, &k, &g, &kb);
      e.failure())
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
                ki = static_cast<int32_t>(k), gi = static_cast<int32_t>(g),
                kbi = static_cast<int32_t>(kb);
  int32_t ret = 0;
  int32_t i = 0;
  // Exported tensor structs: data pointer, dynamic shapes, dynamic strides (the static
  // unit stride left out). rhs is seen as (N, K, G) with strides (1, N, K * N), or
  // (K, 1, N * K) for the K-major variants; rhs_scale as (N, KB, G), strides (1, N, KB * N).
  const int32_t rhs_dyn_stride = k_major ? ki : ni;  // N's stride (K-major) or K's
#define JGM_LAUNCH(name, bk)                                                              \
  if (variant == i++) {                                                                   \
    name##_Tensor_a_t ta = {lhs.untyped_data(), {mi, ki}, {ki}};                          \
    name##_Tensor_b_t tb = {rhs.untyped_data(), {ni, ki, gi}, {rhs_dyn_stride, ki * ni}}; \
    name##_Tensor_b_scale_t ts = {rhs_scale.untyped_data(), {ni, kbi, gi}, {ni, kbi * ni}}; \
    name##_Tensor_out_t to = {out->untyped_data(), {mi, ni}, {ni}};                       \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};                  \
    ret = cute_dsl_##name##_wrapper(&g_##name, &ta, &tb, &ts, &to, &tg, num_sms, stream); \
  }
  JGM_GROUPED_GEMM_W8_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmW8Instantiate, jgm::GroupedGemmW8Instantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation (group_sizes stay on the device); module loaded at instantiate.
// Not kCmdBufferCompatible, for the reason given in grouped_gemm.cc.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JgmGroupedGemmW8, jgm::GroupedGemmW8,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()  // lhs          bf16 [M, K]
        .Arg<xla::ffi::AnyBuffer>()  // rhs          f8e4m3fn [G, K, N] or [G, N, K]
        .Arg<xla::ffi::AnyBuffer>()  // rhs_scale    f8e8m0fnu [G, ceil(K/32), N]
        .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
        .Ret<xla::ffi::AnyBuffer>()  // out          bf16 [M, N]
        .Attr<int32_t>("variant"));
