// XLA FFI handlers for the fp8_block quantize kernels
// (kernels/quantize_fp8_block.py; Python side: _src/cuda/ffi.py).
//
// jgm_quantize_fp8_block_pair: from one read of bf16 x [M, K], the rowwise copy (E4M3
// data, one E8M0 scale per 1 x 128 block along K) and the group-aware columnwise copy
// (128-row blocks that never cross a group: E4M3 data, or its bf16 values, by variant
// X(name, col_type, col_token_major), and the E8M0 scales; col_token_major: the data laid
// out token-major in whole blocks, [K, 128 * NB], as the FP8 weight gradient reads it).
// jgm_quantize_fp8_block: one copy, by variant X(name, rowwise): a weight [G, A, B] read as
// x [G * A, B] with group sizes [A] * G, E4M3 data and one E8M0 scale per 128 x 128 tile in
// group-aware scale rows (rowwise false; transposed true: data [G * B, A], each expert's
// tiles transposed, A % 16 == 0); or x's rowwise copy alone, scales [M, cdiv(K, 128)]
// (rowwise true, group sizes empty).
#include "jgm_variants.h"

namespace jgm {
namespace {

namespace pair {
struct Args {
  Tensor<1> group_sizes;
  Tensor<2> x, row, row_scale, col, col_scale;
};
#define JGM_CALL(a, s) a.x, a.group_sizes, a.row, a.row_scale, a.col, a.col_scale, s
JGM_FAMILY(JGM_QUANTIZE_FP8_BLOCK_PAIR_VARIANTS, "quantize_fp8_block_pair")
#undef JGM_CALL
#define JGM_COL_TYPE(name, type, token_major) type,
const ffi::DataType kColType[] = {JGM_QUANTIZE_FP8_BLOCK_PAIR_VARIANTS(JGM_COL_TYPE)};
#define JGM_COL_TOKEN_MAJOR(name, type, token_major) token_major,
const bool kColTokenMajor[] = {JGM_QUANTIZE_FP8_BLOCK_PAIR_VARIANTS(JGM_COL_TOKEN_MAJOR)};

ffi::Error Execute(cudaStream_t stream, Bf16R2 x, S32R1 group_sizes, Out<Fp8> row,
                   Out<Fp8> row_scale, Out<Fp8> col, Out<Fp8> col_scale, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], g = group_sizes.dimensions()[0],
                kb = CeilDiv(k, 128), nb = CeilDiv(m, 128) + g;
  const bool token_major = kColTokenMajor[variant];  // col [K, 128 NB]: whole blocks, token-major
  Check check("quantize_fp8_block_pair");
  check.Shape("x", x, "[M, K]", {m, k}).Multiple8("K", k)
      .Shape("row", *row, "[M, K]", {m, k})
      .Type("row", row->element_type(), ffi::F8E4M3FN)
      .Shape("row_scale", *row_scale, "[M, cdiv(K, 128)]", {m, kb})
      .Type("row_scale", row_scale->element_type(), ffi::F8E8M0FNU);
  if (token_major)
    check.Shape("col", *col, "[K, 128 * (cdiv(M, 128) + G)]", {k, 128 * nb});
  else
    check.Shape("col", *col, "[M, K]", {m, k});
  auto e = check.Type("col", col->element_type(), kColType[variant])
               .Shape("col_scale", *col_scale, "[cdiv(M, 128) + G, K]", {nb, k})
               .Type("col_scale", col_scale->element_type(), ffi::F8E8M0FNU)
               .Result();
  if (e.failure() || k == 0 || nb == 0) return e;  // (nothing to write)
  Args args{Vector(group_sizes.untyped_data(), g), Matrix(x.untyped_data(), m, k),
            Matrix(row->untyped_data(), m, k), Matrix(row_scale->untyped_data(), m, kb),
            token_major ? Matrix(col->untyped_data(), k, 128 * nb) : Matrix(col->untyped_data(), m, k),
            Matrix(col_scale->untyped_data(), nb, k)};
  return kFamily.Launch(variant, args, stream);
}
}  // namespace pair

namespace tile {
struct Args {
  Tensor<1> group_sizes;
  Tensor<2> x, data, scale;
};
#define JGM_CALL(a, s) a.x, a.group_sizes, a.data, a.scale, s
JGM_FAMILY(JGM_QUANTIZE_FP8_BLOCK_VARIANTS, "quantize_fp8_block")
#undef JGM_CALL
#define JGM_ROWWISE(name, rowwise, transposed) rowwise,
const bool kRowwise[] = {JGM_QUANTIZE_FP8_BLOCK_VARIANTS(JGM_ROWWISE)};
#define JGM_TRANSPOSED(name, rowwise, transposed) transposed,
const bool kTransposed[] = {JGM_QUANTIZE_FP8_BLOCK_VARIANTS(JGM_TRANSPOSED)};

ffi::Error Execute(cudaStream_t stream, Bf16R2 x, S32R1 group_sizes, Out<Fp8> data,
                   Out<Fp8> scale, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], g = group_sizes.dimensions()[0],
                kb = CeilDiv(k, 128), nb = kRowwise[variant] ? m : CeilDiv(m, 128) + g;
  const bool transposed = kTransposed[variant];
  // Transposed: each group's [A, K] rows as [K, A], A = M / G (a weight [G, A, K]).
  const int64_t a = g > 0 ? m / g : 0;
  Check check("quantize_fp8_block");
  check.Shape("x", x, "[M, K]", {m, k}).Multiple8("K", k);
  if (transposed)
    check.AtLeast("G (the weight's groups)", g, 1)
        .MultipleOf("M (G * A, the weight's rows)", m, g > 0 ? g : 1)
        .AtLeast("A (the weight's rows per group)", a, 16)
        .MultipleOf("A (the weight's rows per group)", a, 16)
        .Shape("data", *data, "[G * K, M / G]", {g * k, a});
  else
    check.Shape("data", *data, "[M, K]", {m, k});
  auto e = check.Type("data", data->element_type(), ffi::F8E4M3FN)
               .Shape("scale", *scale, kRowwise[variant] ? "[M, cdiv(K, 128)]" : "[cdiv(M, 128) + G, cdiv(K, 128)]",
                      {nb, kb})
               .Type("scale", scale->element_type(), ffi::F8E8M0FNU)
               .Result();
  if (e.failure() || k == 0 || nb == 0) return e;  // (nothing to write)
  Args args{Vector(group_sizes.untyped_data(), g), Matrix(x.untyped_data(), m, k),
            transposed ? Matrix(data->untyped_data(), g * k, a) : Matrix(data->untyped_data(), m, k),
            Matrix(scale->untyped_data(), nb, kb)};
  return kFamily.Launch(variant, args, stream);
}
}  // namespace tile

}  // namespace
}  // namespace jgm

// No host synchronisation.
JGM_DEFINE_HANDLERS(JgmQuantizeFp8BlockPair, jgm::pair::kFamily, jgm::pair::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Arg<jgm::Bf16R2>()  // x [M, K], K % 8 == 0
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device
                        .Ret<jgm::Fp8>()     // row [M, K] f8e4m3fn
                        .Ret<jgm::Fp8>()     // row_scale [M, cdiv(K, 128)] f8e8m0fnu
                        .Ret<jgm::Fp8>()     // col [M, K] f8e4m3fn or bf16, or [K, 128 NB], by variant
                        .Ret<jgm::Fp8>()     // col_scale [cdiv(M, 128) + G, K] f8e8m0fnu
                        .Attr<int32_t>("variant"));
JGM_DEFINE_HANDLERS(JgmQuantizeFp8Block, jgm::tile::kFamily, jgm::tile::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Arg<jgm::Bf16R2>()  // x [M, K] (a weight: [G * A, B]), K % 8 == 0
                        .Arg<jgm::S32R1>()   // group_sizes [G] (a weight: A each; rowwise: [0])
                        .Ret<jgm::Fp8>()     // data [M, K] f8e4m3fn (transposed: [G * K, M / G])
                        .Ret<jgm::Fp8>()     // scale [cdiv(M, 128) + G or M, cdiv(K, 128)] f8e8m0fnu
                        .Attr<int32_t>("variant"));
