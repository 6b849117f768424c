// XLA FFI handlers for the MXFP8 fake-quantize kernels
// (kernels/fake_quantize_mxfp8.py; Python side: _src/cuda/ffi.py).
//
// jgm_fake_quantize_mxfp8: out = the MXFP8 values of x in bf16, rowwise (32-blocks along
// K) or group-aware columnwise (32-row blocks along M), by variant (X(name)).
// jgm_fake_quantize_pair: both copies from one read of x: out_row the rowwise values,
// out_col the group-aware columnwise values (bf16) or their E4M3 data, by variant
// (X(name, col_type)), and col_scale the columnwise scales.
#include "jgm_variants.h"

namespace jgm {
namespace {

namespace single {
struct Args {
  Tensor<2> x;
  Tensor<1> group_sizes;
  Tensor<2> out;
};
#define JGM_CALL(a, s) a.x, a.group_sizes, a.out, s
JGM_FAMILY(JGM_FAKE_QUANTIZE_VARIANTS, "fake_quantize_mxfp8")
#undef JGM_CALL

ffi::Error Execute(cudaStream_t stream, Bf16R2 x, S32R1 group_sizes, Out<Bf16R2> out,
                   int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], g = group_sizes.dimensions()[0];
  auto e = Check("fake_quantize_mxfp8")
               .Shape("x", x, "[M, K]", {m, k}).Shape("out", *out, "[M, K]", {m, k})
               .Multiple8("K", k).Result();
  if (e.failure() || m == 0 || k == 0) return e;  // (nothing to write)
  Args args{Matrix(x.untyped_data(), m, k), Vector(group_sizes.untyped_data(), g),
            Matrix(out->untyped_data(), m, k)};
  return kFamily.Launch(variant, args, stream);
}
}  // namespace single

namespace pair {
struct Args {
  Tensor<2> x;
  Tensor<1> group_sizes;
  Tensor<2> out_row, out_col, col_scale;
};
#define JGM_CALL(a, s) a.x, a.group_sizes, a.out_row, a.out_col, a.col_scale, s
JGM_FAMILY(JGM_FAKE_QUANTIZE_PAIR_VARIANTS, "fake_quantize_mxfp8_pair")
#define JGM_COL_TYPE(name, type) type,
const ffi::DataType kColType[] = {JGM_FAKE_QUANTIZE_PAIR_VARIANTS(JGM_COL_TYPE)};

ffi::Error Execute(cudaStream_t stream, Bf16R2 x, S32R1 group_sizes, Out<Bf16R2> out_row,
                   Out<Fp8> out_col, Out<Fp8> col_scale, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], g = group_sizes.dimensions()[0],
                nb = CeilDiv(m, 32) + g;
  auto e = Check("fake_quantize_mxfp8_pair")
               .Shape("x", x, "[M, K]", {m, k}).Shape("out_row", *out_row, "[M, K]", {m, k})
               .Shape("out_col", *out_col, "[M, K]", {m, k})
               .Type("out_col", out_col->element_type(), kColType[variant])
               .Shape("col_scale", *col_scale, "[cdiv(M, 32) + G, K]", {nb, k})
               .Type("col_scale", col_scale->element_type(), ffi::F8E8M0FNU)
               .Multiple8("K", k).Result();
  if (e.failure() || k == 0 || nb == 0) return e;  // (nothing to write)
  Args args{Matrix(x.untyped_data(), m, k), Vector(group_sizes.untyped_data(), g),
            Matrix(out_row->untyped_data(), m, k), Matrix(out_col->untyped_data(), m, k),
            Matrix(col_scale->untyped_data(), nb, k)};
  return kFamily.Launch(variant, args, stream);
}
}  // namespace pair

}  // namespace
}  // namespace jgm

// No host synchronisation.
JGM_DEFINE_HANDLERS(JgmFakeQuantize, jgm::single::kFamily, jgm::single::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Arg<jgm::Bf16R2>()  // x [M, K], K % 8 == 0
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device
                        .Ret<jgm::Bf16R2>()  // out [M, K]
                        .Attr<int32_t>("variant"));
JGM_DEFINE_HANDLERS(JgmFakeQuantizePair, jgm::pair::kFamily, jgm::pair::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Arg<jgm::Bf16R2>()  // x [M, K], K % 8 == 0
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device
                        .Ret<jgm::Bf16R2>()  // out_row [M, K]
                        .Ret<jgm::Fp8>()     // out_col [M, K], bf16 or f8e4m3fn by variant
                        .Ret<jgm::Fp8>()     // col_scale [cdiv(M, 32) + G, K] f8e8m0fnu
                        .Attr<int32_t>("variant"));
