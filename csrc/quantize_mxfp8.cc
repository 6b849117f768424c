// XLA FFI handler for the one-pass MXFP8 quantize kernel
// (jax_grouped_mlp/kernels/quantize_mxfp8.py; Python side: _src/ffi.py).
//
// Operands and results (row-major, as XLA lays them out by default):
//   x            bf16   [M, K]            K % 8 == 0, M * K < 2^31
//   group_sizes  s32    [G]               read on the device only
//   row_data     f8e4m3fn  [M, K]
//   row_scale    f8e8m0fnu [M, cdiv(K, 32)]
//   col_data     f8e4m3fn  [M, K]
//   col_scale    f8e8m0fnu [cdiv(M, 32) + G, K]
// Attribute: vec (int32, 4 or 8): which compiled variant (columns per thread).
#include "kernels.h"
#include "quantize_mxfp8_v4_t128.h"
#include "quantize_mxfp8_v8_t128.h"

namespace jgm {
namespace {

quantize_mxfp8_v8_t128_Kernel_Module_t g_module_v8;
quantize_mxfp8_v4_t128_Kernel_Module_t g_module_v4;
ModuleOnce g_once_v8, g_once_v4;

ffi::Error LoadModule(int32_t vec) {
  if (vec == 8) {
    return g_once_v8.Ensure("quantize_mxfp8",
                            [] { quantize_mxfp8_v8_t128_Kernel_Module_Load(&g_module_v8); });
  }
  if (vec == 4) {
    return g_once_v4.Ensure("quantize_mxfp8",
                            [] { quantize_mxfp8_v4_t128_Kernel_Module_Load(&g_module_v4); });
  }
  return ffi::Error::InvalidArgument("quantize_mxfp8: attribute vec=" + std::to_string(vec) +
                                     " not supported (expected 4 or 8)");
}

// The exported tensor structs of both variants have the same layout; fill one.
template <typename X, typename GS, typename RD, typename RS, typename CD, typename CS>
void Fill(X& x, GS& gs, RD& rd, RS& rs, CD& cd, CS& cs, ffi::AnyBuffer in,
          ffi::AnyBuffer sizes, ffi::Result<ffi::AnyBuffer> row_data,
          ffi::Result<ffi::AnyBuffer> row_scale, ffi::Result<ffi::AnyBuffer> col_data,
          ffi::Result<ffi::AnyBuffer> col_scale, int32_t m, int32_t k, int32_t g) {
  const int32_t kb = static_cast<int32_t>(CeilDiv(k, 32));
  const int32_t nb = static_cast<int32_t>(CeilDiv(m, 32) + g);
  x = {in.untyped_data(), {m, k}, {k}};
  gs = {sizes.untyped_data(), {g}};
  rd = {row_data->untyped_data(), {m, k}, {k}};
  rs = {row_scale->untyped_data(), {m, kb}, {kb}};
  cd = {col_data->untyped_data(), {m, k}, {k}};
  cs = {col_scale->untyped_data(), {nb, k}, {k}};
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

ffi::Error QuantizeMxfp8Instantiate(int32_t vec) { return LoadModule(vec); }

ffi::Error QuantizeMxfp8(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                         ffi::Result<ffi::AnyBuffer> row_data,
                         ffi::Result<ffi::AnyBuffer> row_scale,
                         ffi::Result<ffi::AnyBuffer> col_data,
                         ffi::Result<ffi::AnyBuffer> col_scale, int32_t vec) {
  int64_t m, k, g;
  if (auto e = Validate(x, group_sizes, row_data, row_scale, col_data, col_scale, &m, &k, &g);
      e.failure())
    return e;
  // Normally a no-op: the instantiate stage loaded the module already.
  if (auto e = LoadModule(vec); e.failure()) return e;
  if (k == 0 || CeilDiv(m, 32) + g == 0) return ffi::Error::Success();  // nothing to write
  int32_t ret;
  if (vec == 8) {
    quantize_mxfp8_v8_t128_Tensor_x_t tx;
    quantize_mxfp8_v8_t128_Tensor_group_sizes_t tg;
    quantize_mxfp8_v8_t128_Tensor_row_data_t trd;
    quantize_mxfp8_v8_t128_Tensor_row_scale_t trs;
    quantize_mxfp8_v8_t128_Tensor_col_data_t tcd;
    quantize_mxfp8_v8_t128_Tensor_col_scale_t tcs;
    Fill(tx, tg, trd, trs, tcd, tcs, x, group_sizes, row_data, row_scale, col_data, col_scale,
         m, k, g);
    ret = cute_dsl_quantize_mxfp8_v8_t128_wrapper(&g_module_v8, &tx, &tg, &trd, &trs, &tcd,
                                                  &tcs, stream);
  } else {
    quantize_mxfp8_v4_t128_Tensor_x_t tx;
    quantize_mxfp8_v4_t128_Tensor_group_sizes_t tg;
    quantize_mxfp8_v4_t128_Tensor_row_data_t trd;
    quantize_mxfp8_v4_t128_Tensor_row_scale_t trs;
    quantize_mxfp8_v4_t128_Tensor_col_data_t tcd;
    quantize_mxfp8_v4_t128_Tensor_col_scale_t tcs;
    Fill(tx, tg, trd, trs, tcd, tcs, x, group_sizes, row_data, row_scale, col_data, col_scale,
         m, k, g);
    ret = cute_dsl_quantize_mxfp8_v4_t128_wrapper(&g_module_v4, &tx, &tg, &trd, &trs, &tcd,
                                                  &tcs, stream);
  }
  return LaunchResult("quantize_mxfp8", ret);
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmQuantizeMxfp8Instantiate, jgm::QuantizeMxfp8Instantiate,
                              xla::ffi::Ffi::BindInstantiate().Attr<int32_t>("vec"));

// No host synchronisation and no lazy loading per call (the instantiate stage loads
// the module), so XLA may capture it in a CUDA graph.
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
        .Attr<int32_t>("vec"),
    {xla::ffi::Traits::kCmdBufferCompatible});
