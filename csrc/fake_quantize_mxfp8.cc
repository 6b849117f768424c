// XLA FFI handler for the MXFP8 fake-quantize kernel
// (jax_grouped_mlp/kernels/fake_quantize_mxfp8.py; Python side: _src/cuda/ffi.py).
//
//   out = the MXFP8 values of x, in bf16: rowwise (32-blocks along K) or group-aware
//   columnwise (32-row blocks along M), by variant.
//
// Operands and result (row-major):
//   x            bf16 [M, K]    K % 8 == 0, M * K < 2^31
//   group_sizes  s32  [G]       read on the device only
//   out          bf16 [M, K]
// Attribute: variant (int32): index into JGM_FAKE_QUANTIZE_VARIANTS (build/kernels/
// jgm_variants.h, generated from jax_grouped_mlp/kernels/registry.py).
//
// Second target (jgm_fake_quantize_pair): both copies from one read,
//   out_row    bf16 [M, K]                the rowwise MXFP8 values
//   out_col    bf16 [M, K] ("rowcol": the group-aware columnwise values) or
//              f8e4m3fn [M, K] ("row_colq": the columnwise E4M3 data)
//   col_scale  f8e8m0fnu [cdiv(M, 32) + G, K]   the columnwise scales
// Attribute: variant: index into JGM_FAKE_QUANTIZE_PAIR_VARIANTS (the same header);
// X(name, col_type) gives out_col's element type.
// JGM_FAKE_QUANTIZE_VARIANTS(X), X(name), and JGM_FAKE_QUANTIZE_PAIR_VARIANTS(X),
// X(name, col_type): generated from the registry.
#include "jgm_variants.h"

namespace jgm {

const char* const kFakeQuantizeVariants[] = {JGM_FAKE_QUANTIZE_VARIANTS(JGM_VARIANT_NAME)};
const int kNumFakeQuantizeVariants =
    sizeof(kFakeQuantizeVariants) / sizeof(kFakeQuantizeVariants[0]);
const char* const kFakeQuantizePairVariants[] = {JGM_FAKE_QUANTIZE_PAIR_VARIANTS(JGM_VARIANT_NAME)};
const int kNumFakeQuantizePairVariants =
    sizeof(kFakeQuantizePairVariants) / sizeof(kFakeQuantizePairVariants[0]);

namespace {

constexpr const char* kName = "fake_quantize_mxfp8";

constexpr const char* kPairName = "fake_quantize_mxfp8_pair";

JGM_FAKE_QUANTIZE_VARIANTS(JGM_VARIANT_MODULE)
JGM_FAKE_QUANTIZE_PAIR_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_FAKE_QUANTIZE_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumFakeQuantizeVariants);
}

ffi::Error LoadPairModule(int32_t variant) {
  constexpr const char* kName = kPairName;  // read by JGM_VARIANT_LOAD
  int32_t i = 0;
  JGM_FAKE_QUANTIZE_PAIR_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumFakeQuantizePairVariants);
}

// The input checks both targets share: bf16 x [M, K], int32 group_sizes [G].
ffi::Error ValidateInput(const char* name, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                         int64_t* m, int64_t* k, int64_t* g) {
  const std::string pre = std::string(name) + ": ";
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
  return ffi::Error::Success();
}

ffi::Error Validate(ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                    ffi::Result<ffi::AnyBuffer>& out, int64_t* m, int64_t* k, int64_t* g) {
  if (auto e = ValidateInput(kName, x, group_sizes, m, k, g); e.failure()) return e;
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

ffi::Error FakeQuantizePairInstantiate(int32_t variant) { return LoadPairModule(variant); }

ffi::Error FakeQuantizePair(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                            ffi::Result<ffi::AnyBuffer> out_row, ffi::Result<ffi::AnyBuffer> out_col,
                            ffi::Result<ffi::AnyBuffer> col_scale, int32_t variant) {
  int64_t m = 0, k = 0, g = 0;
  if (auto e = ValidateInput(kPairName, x, group_sizes, &m, &k, &g); e.failure()) return e;
  if (auto e = LoadPairModule(variant); e.failure()) return e;  // no-op after instantiate
  const int64_t nb = CeilDiv(m, 32) + g;
  if (nb * k >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument(std::string(kPairName) + ": (cdiv(M, 32) + G) * K = " +
                                       std::to_string(nb * k) + " must be < 2^31");
  if (auto e = CheckBuffer("fake_quantize_mxfp8_pair: out_row", *out_row, ffi::BF16, {m, k});
      e.failure())
    return e;
  ffi::DataType col_type = ffi::BF16;
  {
    int32_t i = 0;
#define JGM_COL_TYPE(name, type) \
  if (variant == i++) col_type = type;
    JGM_FAKE_QUANTIZE_PAIR_VARIANTS(JGM_COL_TYPE)
#undef JGM_COL_TYPE
  }
  if (auto e = CheckBuffer("fake_quantize_mxfp8_pair: out_col", *out_col, col_type, {m, k});
      e.failure())
    return e;
  if (auto e = CheckBuffer("fake_quantize_mxfp8_pair: col_scale", *col_scale, ffi::F8E8M0FNU,
                           {nb, k});
      e.failure())
    return e;
  if (k == 0 || nb == 0) return ffi::Error::Success();  // nothing to write
  const int32_t mi = static_cast<int32_t>(m), ki = static_cast<int32_t>(k),
                gi = static_cast<int32_t>(g), nbi = static_cast<int32_t>(nb);
  int32_t ret = 0;
  int32_t i = 0;
#define JGM_LAUNCH(name, type)                                                           \
  if (variant == i++) {                                                                  \
    name##_Tensor_x_t tx = {x.untyped_data(), {mi, ki}, {ki}};                           \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};                 \
    name##_Tensor_out_row_t tr = {out_row->untyped_data(), {mi, ki}, {ki}};              \
    name##_Tensor_out_col_t tc = {out_col->untyped_data(), {mi, ki}, {ki}};              \
    name##_Tensor_col_scale_t ts = {col_scale->untyped_data(), {nbi, ki}, {ki}};         \
    ret = cute_dsl_##name##_wrapper(&g_##name, &tx, &tg, &tr, &tc, &ts, stream);         \
  }
  JGM_FAKE_QUANTIZE_PAIR_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult(kPairName, ret);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmFakeQuantizePairInstantiate, jgm::FakeQuantizePairInstantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmFakeQuantizePair, jgm::FakeQuantizePair,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x            bf16 [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()  // group_sizes  s32 [G]
                                  .Ret<xla::ffi::AnyBuffer>()  // out_row      bf16 [M, K]
                                  .Ret<xla::ffi::AnyBuffer>()  // out_col      bf16 or e4m3 [M, K]
                                  .Ret<xla::ffi::AnyBuffer>()  // col_scale    e8m0 [NB, K]
                                  .Attr<int32_t>("variant"));
