// XLA FFI handler for the Hopper MXFP8 grouped GEMM over ragged M (FP8 wgmma with
// per-32-K promotion; jax_grouped_mlp/kernels/grouped_gemm_fp8_sm90.py; Python side:
// _src/gemm_fp8_ffi.py).
//
//   out[m, n] = sum_kb sa[kb, m] * sb[g, kb, n'] * (a[m, kb] . b[g, n, kb]),  g = group(m),
//   rows at or past sum(group_sizes) are zero.
//
// Operands and result (row-major, XLA's default layout):
//   a            f8e4m3fn [M, K]        K % 16 == 0 (16-byte TMA row stride)
//   b            f8e4m3fn [G, N, K]     N % 8 == 0 (bf16 output rows)
//   sa           f32 [KB, Mp]           KB = cdiv(K, 32), Mp = round_up(M, 4): decoded scales of a
//   sb           f32 [G, KB, Np]        Np = round_up(N, tile_n): decoded scales of b, columns
//                                       permuted within each tile_n chunk (see the kernel)
//   group_sizes  s32 [G]                read on the device only (clamped there)
//   out          bf16 [M, N]
// Attribute: variant (int32): index into JGM_GROUPED_GEMM_FP8_VARIANTS (the same list
// as jax_grouped_mlp/kernels/aot.py's _grouped_gemm_fp8_variants).
#include "kernels.h"  // first: it defines CUTE_DSL_CUDA_ERROR_CHECK for the headers below
#include "grouped_gemm_sm90_mxfp8_m128n128k128_s5_t1.h"
#include "grouped_gemm_sm90_mxfp8_m128n128k128_s5_t2.h"
#include "grouped_gemm_sm90_mxfp8_m128n192k128_s4_t1.h"

// X(name, tile_n): every exported variant, in the order of the `variant` attribute.
#define JGM_GROUPED_GEMM_FP8_VARIANTS(X)              \
  X(grouped_gemm_sm90_mxfp8_m128n128k128_s5_t2, 128) \
  X(grouped_gemm_sm90_mxfp8_m128n128k128_s5_t1, 128) \
  X(grouped_gemm_sm90_mxfp8_m128n192k128_s4_t1, 192)

namespace jgm {

const char* const kGroupedGemmFp8Variants[] = {JGM_GROUPED_GEMM_FP8_VARIANTS(JGM_VARIANT_NAME)};
const int kNumGroupedGemmFp8Variants =
    sizeof(kGroupedGemmFp8Variants) / sizeof(kGroupedGemmFp8Variants[0]);

namespace {

constexpr const char* kName = "grouped_gemm_fp8";

JGM_GROUPED_GEMM_FP8_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_GROUPED_GEMM_FP8_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumGroupedGemmFp8Variants);
}

// The CTA tile width of variant `variant` (already range-checked).
int64_t TileN(int32_t variant) {
  const int64_t tile_n[] = {
#define JGM_TILE_N(name, tn) tn,
      JGM_GROUPED_GEMM_FP8_VARIANTS(JGM_TILE_N)
#undef JGM_TILE_N
  };
  return tile_n[variant];
}

struct Dims {
  int64_t m = 0, n = 0, k = 0, g = 0, kb = 0, mp = 0, np = 0;
};

ffi::Error Validate(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa, ffi::AnyBuffer sb,
                    ffi::AnyBuffer group_sizes, const ffi::Result<ffi::AnyBuffer>& out,
                    int64_t tile_n, Dims* d) {
  const std::string pre = std::string(kName) + ": ";
  if (a.element_type() != ffi::F8E4M3FN || a.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "a must be a float8_e4m3fn [M, K] array, got shape " +
                                       DimsToString(a.dimensions()));
  if (b.element_type() != ffi::F8E4M3FN || b.dimensions().size() != 3)
    return ffi::Error::InvalidArgument(pre + "b must be a float8_e4m3fn [G, N, K] array, got shape " +
                                       DimsToString(b.dimensions()));
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  d->m = a.dimensions()[0];
  d->k = a.dimensions()[1];
  d->g = b.dimensions()[0];
  d->n = b.dimensions()[1];
  if (b.dimensions()[2] != d->k)
    return ffi::Error::InvalidArgument(pre + "b " + DimsToString(b.dimensions()) +
                                       " does not match a " + DimsToString(a.dimensions()) + " in K");
  if (group_sizes.dimensions()[0] != d->g)
    return ffi::Error::InvalidArgument(pre + "group_sizes has " +
                                       std::to_string(group_sizes.dimensions()[0]) +
                                       " entries but b has G=" + std::to_string(d->g));
  if (d->k % 16 != 0 || d->n % 8 != 0)
    return ffi::Error::InvalidArgument(pre + "K=" + std::to_string(d->k) + " must be a multiple of 16 and N=" +
                                       std::to_string(d->n) + " of 8 (16-byte TMA strides)");
  d->kb = CeilDiv(d->k, 32);
  d->mp = CeilDiv(d->m, 4) * 4;
  d->np = CeilDiv(d->n, tile_n) * tile_n;
  constexpr int64_t kMax = int64_t{1} << 31;
  if (d->m * d->k >= kMax || d->m * d->n >= kMax || d->g * d->k * d->n >= kMax ||
      d->g * d->kb * d->np >= kMax || d->kb * d->mp >= kMax)
    return ffi::Error::InvalidArgument(pre + "operands must have < 2^31 elements each (32-bit "
                                       "offsets), got M=" + std::to_string(d->m) + " N=" +
                                       std::to_string(d->n) + " K=" + std::to_string(d->k) +
                                       " G=" + std::to_string(d->g));
  if (auto e = CheckBuffer("grouped_gemm_fp8: sa", sa, ffi::F32, {d->kb, d->mp}); e.failure()) return e;
  if (auto e = CheckBuffer("grouped_gemm_fp8: sb", sb, ffi::F32, {d->g, d->kb, d->np}); e.failure())
    return e;
  return CheckBuffer("grouped_gemm_fp8: out", *out, ffi::BF16, {d->m, d->n});
}

ffi::Error GroupedGemmFp8Instantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error GroupedGemmFp8(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa,
                          ffi::AnyBuffer sb, ffi::AnyBuffer group_sizes,
                          ffi::Result<ffi::AnyBuffer> out, int32_t variant) {
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  Dims d;
  if (auto e = Validate(a, b, sa, sb, group_sizes, out, TileN(variant), &d); e.failure()) return e;
  if (d.m == 0 || d.n == 0) return ffi::Error::Success();
  if (d.g == 0 || d.k == 0) {
    // Every row is past the groups (G = 0) or every product is empty (K = 0).
    // A TMA descriptor cannot have an empty dimension, so no launch.
    cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return LaunchResult(kName, static_cast<int32_t>(err));
  }
  int32_t num_sms = 0;
  if (auto e = NumSms(kName, stream, &num_sms); e.failure()) return e;
  const int32_t mi = static_cast<int32_t>(d.m), ni = static_cast<int32_t>(d.n),
                ki = static_cast<int32_t>(d.k), gi = static_cast<int32_t>(d.g),
                kbi = static_cast<int32_t>(d.kb), mpi = static_cast<int32_t>(d.mp),
                npi = static_cast<int32_t>(d.np);
  int32_t ret = 0;
  int32_t i = 0;
  // Exported tensor structs: data pointer, dynamic shapes, dynamic strides (the static
  // unit stride left out). b is seen as (N, K, G) with strides (K, 1, N * K); sa as
  // (Mp, KB) with strides (1, Mp); sb as (Np, KB, G) with strides (1, Np, KB * Np).
#define JGM_LAUNCH(name, tn)                                                               \
  if (variant == i++) {                                                                    \
    name##_Tensor_a_t ta = {a.untyped_data(), {mi, ki}, {ki}};                             \
    name##_Tensor_b_t tb = {b.untyped_data(), {ni, ki, gi}, {ki, ni * ki}};                \
    name##_Tensor_sa_t tsa = {sa.untyped_data(), {mpi, kbi}, {mpi}};                       \
    name##_Tensor_sb_t tsb = {sb.untyped_data(), {npi, kbi, gi}, {npi, kbi * npi}};        \
    name##_Tensor_out_t to = {out->untyped_data(), {mi, ni}, {ni}};                        \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};                   \
    ret = cute_dsl_##name##_wrapper(&g_##name, &ta, &tb, &tsa, &tsb, &to, &tg, num_sms, stream); \
  }
  JGM_GROUPED_GEMM_FP8_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmFp8Instantiate, jgm::GroupedGemmFp8Instantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation (group_sizes stay on the device); module loaded at instantiate.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JgmGroupedGemmFp8, jgm::GroupedGemmFp8,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()  // a            f8e4m3fn [M, K]
        .Arg<xla::ffi::AnyBuffer>()  // b            f8e4m3fn [G, N, K]
        .Arg<xla::ffi::AnyBuffer>()  // sa           f32 [KB, Mp]
        .Arg<xla::ffi::AnyBuffer>()  // sb           f32 [G, KB, Np]
        .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
        .Ret<xla::ffi::AnyBuffer>()  // out          bf16 [M, N]
        .Attr<int32_t>("variant"));
// Not kCmdBufferCompatible, like the other handlers (see grouped_gemm.cc).
