// XLA FFI handler for the one-pass MXFP8 quantize kernel
// (jax_grouped_mlp/kernels/quantize_mxfp8.py; Python side: _src/cuda/ffi.py).
//
// Operands and results (row-major, as XLA lays them out by default):
//   x            bf16   [M, K]            K % 8 == 0, M * K and (cdiv(M,32)+G) * K < 2^31
//   group_sizes  s32    [G]               read on the device only
//   row_data     f8e4m3fn  [M, K]
//   row_scale    f8e8m0fnu [M, cdiv(K, 32)]
//   col_data     f8e4m3fn  [M, K]
//   col_scale    f8e8m0fnu [cdiv(M, 32) + G, K]
// Attribute: variant (int32): index into JGM_QUANTIZE_VARIANTS, the compiled
// kernel configurations (jax_grouped_mlp/kernels/aot.py builds the same list).
#include "kernels.h"
#include "quantize_mxfp8_v4_t128.h"
#include "quantize_mxfp8_v4_t256_b2.h"
#include "quantize_mxfp8_v8_t128.h"
#include "quantize_mxfp8_v8_t128_b3.h"

// X(name): every exported variant, in the order of the `variant` attribute.
#define JGM_QUANTIZE_VARIANTS(X) \
  X(quantize_mxfp8_v8_t128)      \
  X(quantize_mxfp8_v8_t128_b3)   \
  X(quantize_mxfp8_v4_t128)      \
  X(quantize_mxfp8_v4_t256_b2)

namespace jgm {

const char* const kQuantizeVariants[] = {JGM_QUANTIZE_VARIANTS(JGM_VARIANT_NAME)};
const int kNumQuantizeVariants = sizeof(kQuantizeVariants) / sizeof(kQuantizeVariants[0]);

namespace {

constexpr const char* kName = "quantize_mxfp8";

JGM_QUANTIZE_VARIANTS(JGM_VARIANT_MODULE)

ffi::Error LoadModule(int32_t variant) {
  int32_t i = 0;
  JGM_QUANTIZE_VARIANTS(JGM_VARIANT_LOAD)
  return VariantOutOfRange(kName, variant, kNumQuantizeVariants);
}

ffi::Error Validate(ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                    ffi::Result<ffi::AnyBuffer> row_data,
                    ffi::Result<ffi::AnyBuffer> row_scale,
                    ffi::Result<ffi::AnyBuffer> col_data,
                    ffi::Result<ffi::AnyBuffer> col_scale, int64_t* m, int64_t* k,
                    int64_t* g) {
  if (x.element_type() != ffi::BF16 || x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("quantize_mxfp8: x must be a bf16 [M, K] array, got shape " +
                                       DimsToString(x.dimensions()));
  }
  *m = x.dimensions()[0];
  *k = x.dimensions()[1];
  if (*k % 8 != 0) {
    return ffi::Error::InvalidArgument("quantize_mxfp8: x has K=" + std::to_string(*k) +
                                       ", which must be a multiple of 8");
  }
  if (*m * *k >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument("quantize_mxfp8: x has M*K=" + std::to_string(*m * *k) +
                                       " elements; the kernel uses 32-bit offsets (< 2^31)");
  }
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(
        "quantize_mxfp8: group_sizes must be an int32 [G] array, got shape " +
        DimsToString(group_sizes.dimensions()));
  }
  *g = group_sizes.dimensions()[0];
  if ((CeilDiv(*m, 32) + *g) * *k >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument(
        "quantize_mxfp8: col_scale would have (cdiv(M, 32) + G) * K = " +
        std::to_string((CeilDiv(*m, 32) + *g) * *k) + " elements; must be < 2^31");
  }
  if (auto e = CheckBuffer("quantize_mxfp8: row_data", *row_data, ffi::F8E4M3FN, {*m, *k});
      e.failure())
    return e;
  if (auto e = CheckBuffer("quantize_mxfp8: row_scale", *row_scale, ffi::F8E8M0FNU,
                           {*m, CeilDiv(*k, 32)});
      e.failure())
    return e;
  if (auto e = CheckBuffer("quantize_mxfp8: col_data", *col_data, ffi::F8E4M3FN, {*m, *k});
      e.failure())
    return e;
  if (auto e = CheckBuffer("quantize_mxfp8: col_scale", *col_scale, ffi::F8E8M0FNU,
                           {CeilDiv(*m, 32) + *g, *k});
      e.failure())
    return e;
  return ffi::Error::Success();
}

ffi::Error QuantizeMxfp8Instantiate(int32_t variant) { return LoadModule(variant); }

ffi::Error QuantizeMxfp8(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                         ffi::Result<ffi::AnyBuffer> row_data,
                         ffi::Result<ffi::AnyBuffer> row_scale,
                         ffi::Result<ffi::AnyBuffer> col_data,
                         ffi::Result<ffi::AnyBuffer> col_scale, int32_t variant) {
  int64_t m = 0, k = 0, g = 0;
  if (auto e = Validate(x, group_sizes, row_data, row_scale, col_data, col_scale, &m, &k, &g);
      e.failure())
    return e;
  // Normally a no-op: the instantiate stage loaded the module already.
  if (auto e = LoadModule(variant); e.failure()) return e;
  if (k == 0 || CeilDiv(m, 32) + g == 0) return ffi::Error::Success();  // nothing to write
  const int32_t kb = static_cast<int32_t>(CeilDiv(k, 32));
  const int32_t nb = static_cast<int32_t>(CeilDiv(m, 32) + g);
  const int32_t mi = static_cast<int32_t>(m), ki = static_cast<int32_t>(k),
                gi = static_cast<int32_t>(g);
  int32_t ret = 0;
  int32_t i = 0;
  // The exported tensor structs: data pointer, dynamic shapes, dynamic row stride.
#define JGM_LAUNCH(name)                                                                    \
  if (variant == i++) {                                                                     \
    name##_Tensor_x_t tx = {x.untyped_data(), {mi, ki}, {ki}};                              \
    name##_Tensor_group_sizes_t tg = {group_sizes.untyped_data(), {gi}};                    \
    name##_Tensor_row_data_t trd = {row_data->untyped_data(), {mi, ki}, {ki}};              \
    name##_Tensor_row_scale_t trs = {row_scale->untyped_data(), {mi, kb}, {kb}};            \
    name##_Tensor_col_data_t tcd = {col_data->untyped_data(), {mi, ki}, {ki}};              \
    name##_Tensor_col_scale_t tcs = {col_scale->untyped_data(), {nb, ki}, {ki}};            \
    ret = cute_dsl_##name##_wrapper(&g_##name, &tx, &tg, &trd, &trs, &tcd, &tcs, stream); \
  }
  JGM_QUANTIZE_VARIANTS(JGM_LAUNCH)
#undef JGM_LAUNCH
  return LaunchResult("quantize_mxfp8", ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmQuantizeMxfp8Instantiate, jgm::QuantizeMxfp8Instantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("variant"));

// No host synchronisation; the instantiate stage loads the module.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JgmQuantizeMxfp8, jgm::QuantizeMxfp8,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()     // x
        .Arg<xla::ffi::AnyBuffer>()     // group_sizes
        .Ret<xla::ffi::AnyBuffer>()     // row_data
        .Ret<xla::ffi::AnyBuffer>()     // row_scale
        .Ret<xla::ffi::AnyBuffer>()     // col_data
        .Ret<xla::ffi::AnyBuffer>()     // col_scale
        .Attr<int32_t>("variant"));
// Not marked kCmdBufferCompatible: on the H200 the exported DSL launch wrapper failed
// inside XLA's CUDA-graph capture ("operation not permitted when stream is capturing"),
// so XLA must run these custom calls outside command buffers until that is fixed.
