// The FP8 block-scaled operands that the forward GEMM handlers share (the plain GEMM,
// grouped_gemm_fp8_block.cc, and the FC1 GEMM, grouped_gemm_fp8_block_fc1.cc): checked and
// described once, so the two kernels can never be handed operands checked differently.
//
//   lhs [M, K] f8e4m3fn with 1 x 128 scales lhs_scale [M, cdiv(K, 128)] f8e8m0fnu;
//   rhs [G, N, K] f8e4m3fn (K contiguous) with 128 x 128 scales
//   rhs_scale [G, cdiv(N, 128), cdiv(K, 128)] f8e8m0fnu.
#pragma once

#include "kernels.h"

namespace jgm {

constexpr int64_t kFp8Block = 128;  // the scale block along K, and along N for rhs

struct Fp8BlockDims {
  int64_t m, k, g, n, kb, nb;
};

inline Fp8BlockDims Fp8BlockDimsOf(const Fp8& lhs, const Fp8& rhs) {
  const int64_t k = Dim(lhs, 1), n = Dim(rhs, 1);
  return {Dim(lhs, 0), k, Dim(rhs, 0), n, CeilDiv(k, kFp8Block), CeilDiv(n, kFp8Block)};
}

// The four operands' shapes and element types, and K % 16 == 0, N % 8 == 0 (TMA strides).
inline Check& CheckFp8BlockOperands(Check& check, const Fp8BlockDims& d, const Fp8& lhs,
                                    const Fp8& lhs_scale, const Fp8& rhs, const Fp8& rhs_scale) {
  return check.Shape("lhs", lhs, "[M, K]", {d.m, d.k})
      .Type("lhs", lhs.element_type(), ffi::F8E4M3FN)
      .Shape("lhs_scale", lhs_scale, "[M, cdiv(K, 128)]", {d.m, d.kb})
      .Type("lhs_scale", lhs_scale.element_type(), ffi::F8E8M0FNU)
      .Shape("rhs", rhs, "[G, N, K]", {d.g, d.n, d.k})
      .Type("rhs", rhs.element_type(), ffi::F8E4M3FN)
      .Shape("rhs_scale", rhs_scale, "[G, cdiv(N, 128), cdiv(K, 128)]", {d.g, d.nb, d.kb})
      .Type("rhs_scale", rhs_scale.element_type(), ffi::F8E8M0FNU)
      .MultipleOf("K", d.k, 16)
      .Multiple8("N", d.n);
}

// The kernels' views of the operands (after the check): rhs [G, N, K] as (N, K, G) with
// strides (K, 1, N * K); the scales as stored.
struct Fp8BlockOperands {
  Tensor<2> a;
  Tensor<3> b;
  Tensor<2> sa;
  Tensor<3> sb;
};

inline Fp8BlockOperands Fp8BlockOperandsOf(const Fp8BlockDims& d, const Fp8& lhs,
                                           const Fp8& lhs_scale, const Fp8& rhs,
                                           const Fp8& rhs_scale) {
  return {Matrix(lhs.untyped_data(), d.m, d.k),
          Batched(rhs.untyped_data(), d.n, d.k, d.g, d.k, d.k * d.n),
          Matrix(lhs_scale.untyped_data(), d.m, d.kb),
          {rhs_scale.untyped_data(), {I32(d.g), I32(d.nb), I32(d.kb)}, {I32(d.nb * d.kb), I32(d.kb)}}};
}

}  // namespace jgm
