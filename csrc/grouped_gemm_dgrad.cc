// XLA FFI handler for the Hopper grouped GEMM with the FC2-dgrad (dSReLU) epilogue
// (jax_grouped_mlp/kernels/grouped_gemm_dgrad_sm90.py; Python side: _src/cuda/gemm_ffi.py).
// STATUS: GPU-tested on the H200 (tests/test_grouped_gemm_dgrad_gpu.py).
//
//   da[m] = dy[m] @ w2[group(m)]^T  (bf16-rounded exactly as jgm_grouped_gemm's _bk variants,
//   never written), dh = bf16((da * (2 * probs)) * relu(h)) as MXFP8 values in bf16: dh_row
//   (32-blocks along N) and dh_col (group-aware 32-row blocks); dpart[t, m] = sum over
//   column tile t of da * relu(h)^2 (the binding adds the tiles in order).
//
// Operands and results (row-major, XLA's default layout):
//   dy           bf16 [M, K]       K % 8 == 0
//   w2           bf16 [G, N, K]    N % 8 == 0 (K contiguous: the FC2 weight [G, F, H] as stored)
//   group_sizes  s32  [G]          read on the device only (clamped there)
//   h            bf16 [M, N]
//   probs        f32  [M]
//   dh_row       bf16 [M, N]
//   dh_col       bf16 [M, N]
//   dpart        f32  [ceil(N / tile_n), M]   tile_n of the variant
// The kernel writes every element of the results (rows past the groups: zeros), so
// nothing is cleared before a launch.
// Attribute: variant (int32): index into JGM_GROUPED_GEMM_DGRAD_VARIANTS (build/kernels/jgm_variants.h,
// generated from jax_grouped_mlp/kernels/registry.py).
// JGM_GROUPED_GEMM_DGRAD_VARIANTS(X), X(name, tile_n): generated from the registry.
#include "jgm_variants.h"

namespace jgm {

const char* const kGroupedGemmDgradVariants[] = {
    JGM_GROUPED_GEMM_DGRAD_VARIANTS(JGM_VARIANT_NAME)};
const int kNumGroupedGemmDgradVariants =
    sizeof(kGroupedGemmDgradVariants) / sizeof(kGroupedGemmDgradVariants[0]);

namespace {

constexpr const char* kName = "grouped_gemm_dgrad";

JGM_GROUPED_GEMM_DGRAD_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_GROUPED_GEMM_DGRAD_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumGroupedGemmDgradVariants);
}

// The variant's CTA tile width (after LoadModule accepted `variant`).
int64_t TileN(int32_t variant) {
  const int64_t tile_n[] = {
#define JGM_TILE_N(name, tn) tn,
      JGM_GROUPED_GEMM_DGRAD_VARIANTS(JGM_TILE_N)
#undef JGM_TILE_N
  };
  return tile_n[variant];
}

ffi::Error Validate(ffi::AnyBuffer dy, ffi::AnyBuffer w2, ffi::AnyBuffer group_sizes,
                    ffi::AnyBuffer h, ffi::AnyBuffer probs,
                    ffi::Result<ffi::AnyBuffer>& dh_row,
                    ffi::Result<ffi::AnyBuffer>& dh_col,
                    ffi::Result<ffi::AnyBuffer>& dpart, int64_t tile_n, int64_t* m,
                    int64_t* n, int64_t* k, int64_t* g, int64_t* nt) {
  const std::string pre = std::string(kName) + ": ";
  if (dy.element_type() != ffi::BF16 || dy.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(pre + "dy must be a bf16 [M, K] array, got shape " +
                                       DimsToString(dy.dimensions()));
  if (w2.element_type() != ffi::BF16 || w2.dimensions().size() != 3)
    return ffi::Error::InvalidArgument(pre + "w2 must be a bf16 [G, N, K] array, got shape " +
                                       DimsToString(w2.dimensions()));
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(pre + "group_sizes must be an int32 [G] array, got shape " +
                                       DimsToString(group_sizes.dimensions()));
  *m = dy.dimensions()[0];
  *k = dy.dimensions()[1];
  *g = w2.dimensions()[0];
  *n = w2.dimensions()[1];
  *nt = CeilDiv(*n, tile_n);
  if (w2.dimensions()[2] != *k)
    return ffi::Error::InvalidArgument(pre + "w2 " + DimsToString(w2.dimensions()) +
                                       " does not match dy " + DimsToString(dy.dimensions()) +
                                       " in K");
  if (group_sizes.dimensions()[0] != *g)
    return ffi::Error::InvalidArgument(pre + "group_sizes has " +
                                       std::to_string(group_sizes.dimensions()[0]) +
                                       " entries but w2 has G=" + std::to_string(*g));
  if (auto e = CheckBuffer("grouped_gemm_dgrad: h", h, ffi::BF16, {*m, *n}); e.failure())
    return e;
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
  if (*m * *k >= kMax || *m * *n >= kMax || *g * *k * *n >= kMax || *nt * *m >= kMax)
    return ffi::Error::InvalidArgument(pre + "operands must have < 2^31 elements each (32-bit "
                                       "offsets), got M=" + std::to_string(*m) + " N=" +
                                       std::to_string(*n) + " K=" + std::to_string(*k) +
                                       " G=" + std::to_string(*g));
  if (auto e = CheckBuffer("grouped_gemm_dgrad: dh_row", *dh_row, ffi::BF16, {*m, *n});
      e.failure())
    return e;
  if (auto e = CheckBuffer("grouped_gemm_dgrad: dh_col", *dh_col, ffi::BF16, {*m, *n});
      e.failure())
    return e;
  return CheckBuffer("grouped_gemm_dgrad: dpart", *dpart, ffi::F32, {*nt, *m});
}

ffi::Error GroupedGemmDgradInstantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error GroupedGemmDgrad(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w2,
                            ffi::AnyBuffer group_sizes, ffi::AnyBuffer h, ffi::AnyBuffer probs,
                            ffi::Result<ffi::AnyBuffer> dh_row,
                            ffi::Result<ffi::AnyBuffer> dh_col,
                            ffi::Result<ffi::AnyBuffer> dpart, int32_t variant) {
  int64_t m = 0, n = 0, k = 0, g = 0, nt = 0;
  if (auto e = LoadModule(variant); e.failure()) return e;  // no-op after instantiate
  if (auto e = Validate(dy, w2, group_sizes, h, probs, dh_row, dh_col, dpart, TileN(variant),
                        &m, &n, &k, &g, &nt);
      e.failure())
    return e;
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (g == 0 || k == 0) {
    // No launch (a TMA descriptor cannot have an empty dimension): zeros. The Python
    // binding never gets here (it computes these static cases exactly in JAX); here
    // the groups' rows are +0 where the exact result is bf16(0 * 2 probs * relu(h))
    // (-0 for negative probs, NaN for non-finite h or probs).
    for (auto* buf : {&dh_row, &dh_col, &dpart}) {
      cudaError_t err = cudaMemsetAsync((*buf)->untyped_data(), 0, (*buf)->size_bytes(), stream);
      if (err != cudaSuccess) return LaunchResult(kName, static_cast<int32_t>(err));
    }
    return ffi::Error::Success();
  }
  int32_t num_sms = 0;
  if (auto e = NumSms(kName, stream, &num_sms); e.failure()) return e;
  const int32_t mi = static_cast<int32_t>(m), ni = static_cast<int32_t>(n),
                ki = static_cast<int32_t>(k), gi = static_cast<int32_t>(g),
                nti = static_cast<int32_t>(nt);
  int32_t ret = 0;
  int32_t i = 0;
  // Exported tensor structs: data pointer, dynamic shapes, dynamic strides (the static
  // unit stride left out). w2 is seen as (N, K, G) with strides (K, 1, N * K).
#define JGM_LAUNCH(name, tn)                                                             \
  if (variant == i++) {                                                                  \
    name##_Tensor_a_t ta = {dy.untyped_data(), {mi, ki}, {ki}};                          \
    name##_Tensor_b_t tb = {w2.untyped_data(), {ni, ki, gi}, {ki, ki * ni}};             \
    name##_Tensor_h_t th = {h.untyped_data(), {mi, ni}, {ni}};                           \
    name##_Tensor_dh_row_t tr = {dh_row->untyped_data(), {mi, ni}, {ni}};                \
    name##_Tensor_dh_col_t tc = {dh_col->untyped_data(), {mi, ni}, {ni}};                \
    name##_Tensor_dpart_t tp = {dpart->untyped_data(), {nti, mi}, {mi}};                 \
    name##_Tensor_probs_t tq = {probs.untyped_data(), {mi}};                             \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};                 \
    ret = cute_dsl_##name##_wrapper(&g_##name, &ta, &tb, &th, &tr, &tc, &tp, &tq, &tg,   \
                                    num_sms, stream);                                    \
  }
  JGM_GROUPED_GEMM_DGRAD_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kName, ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmDgradInstantiate, jgm::GroupedGemmDgradInstantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation (group_sizes stay on the device); module loaded at instantiate.
// Not kCmdBufferCompatible, for the reason given in grouped_gemm.cc.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JgmGroupedGemmDgrad, jgm::GroupedGemmDgrad,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()  // dy           bf16 [M, K]
        .Arg<xla::ffi::AnyBuffer>()  // w2           bf16 [G, N, K]
        .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
        .Arg<xla::ffi::AnyBuffer>()  // h            bf16 [M, N]
        .Arg<xla::ffi::AnyBuffer>()  // probs        f32 [M]
        .Ret<xla::ffi::AnyBuffer>()  // dh_row       bf16 [M, N]
        .Ret<xla::ffi::AnyBuffer>()  // dh_col       bf16 [M, N]
        .Ret<xla::ffi::AnyBuffer>()  // dpart        f32 [ceil(N / tile_n), M]
        .Attr<int32_t>("variant"));
