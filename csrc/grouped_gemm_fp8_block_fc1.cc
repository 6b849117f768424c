// XLA FFI handler for the Hopper FP8 block-scaled grouped GEMM with the FC1 epilogue
// (kernels/grouped_gemm_fp8_block_fc1_sm90.py; Python side: _src/cuda/gemm_ffi.py,
// fp8_block_fc1_fused_cuda).
//
//   h[m] = the FP8 block-scaled product of jgm_grouped_gemm_fp8_block (bitwise), and from
//   it a = bf16(probs * relu(h)^2) in both fp8_block copies: a_row (1 x 128 blocks along
//   N: E4M3 data + E8M0 scales [M, cdiv(N, 128)]) and a_col (group-aware 128-row blocks:
//   E4M3 data + E8M0 scales [cdiv(M, 128) + G, N]). The kernel writes only the groups'
//   column scale rows: a_col_scale is cleared here first.
//
// Attribute variant: index into JGM_GROUPED_GEMM_FP8_BLOCK_FC1_VARIANTS, X(name).
#include "fp8_block_operands.h"
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Fp8BlockOperands in;
  Tensor<2> h, a_row, a_row_scale, a_col, a_col_scale;
  Tensor<1> probs, group_sizes;
  int32_t num_sms;
};
#define JGM_CALL(a, s)                                                                        \
  a.in.a, a.in.b, a.in.sa, a.in.sb, a.h, a.a_row, a.a_row_scale, a.a_col, a.a_col_scale, a.probs, \
      a.group_sizes, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_GEMM_FP8_BLOCK_FC1_VARIANTS, "grouped_gemm_fp8_block_fc1")

ffi::Error Execute(cudaStream_t stream, int32_t device, Fp8 lhs, Fp8 lhs_scale, Fp8 rhs,
                   Fp8 rhs_scale, S32R1 group_sizes, F32R1 probs, Out<Bf16R2> h,
                   Out<Fp8> a_row, Out<Fp8> a_row_scale, Out<Fp8> a_col, Out<Fp8> a_col_scale,
                   int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const Fp8BlockDims d = Fp8BlockDimsOf(lhs, rhs);
  const int64_t m = d.m, k = d.k, g = d.g, n = d.n, nb = d.nb,
                bb = CeilDiv(m, kFp8Block) + g;  // a_col's scale rows: group-aware 128-row blocks
  Check check("grouped_gemm_fp8_block_fc1");
  auto e = CheckFp8BlockOperands(check, d, lhs, lhs_scale, rhs, rhs_scale)
               .Shape("group_sizes", group_sizes, "[G]", {g}).Shape("probs", probs, "[M]", {m})
               .Shape("h", *h, "[M, N]", {m, n})
               .Shape("a_row", *a_row, "[M, N]", {m, n})
               .Type("a_row", a_row->element_type(), ffi::F8E4M3FN)
               .Shape("a_row_scale", *a_row_scale, "[M, cdiv(N, 128)]", {m, nb})
               .Type("a_row_scale", a_row_scale->element_type(), ffi::F8E8M0FNU)
               .Shape("a_col", *a_col, "[M, N]", {m, n})
               .Type("a_col", a_col->element_type(), ffi::F8E4M3FN)
               .Shape("a_col_scale", *a_col_scale, "[cdiv(M, 128) + G, N]", {bb, n})
               .Type("a_col_scale", a_col_scale->element_type(), ffi::F8E8M0FNU)
               .Result();
  if (e.failure()) return e;
  if (auto e = Status("grouped_gemm_fp8_block_fc1", Zero(stream, *a_col_scale)); e.failure()) return e;
  if (m == 0 || n == 0) return ffi::Error::Success();
  // The Python binding computes the cases without a launch (G = 0 or K = 0) in JAX and
  // never gets here (a TMA descriptor cannot have an empty dimension).
  if (g == 0 || k == 0) return ffi::Error::InvalidArgument("grouped_gemm_fp8_block_fc1: G and K must be > 0");
  Args args{Fp8BlockOperandsOf(d, lhs, lhs_scale, rhs, rhs_scale),
            Matrix(h->untyped_data(), m, n),
            Matrix(a_row->untyped_data(), m, n),
            Matrix(a_row_scale->untyped_data(), m, nb),
            Matrix(a_col->untyped_data(), m, n),
            Matrix(a_col_scale->untyped_data(), bb, n),
            Vector(probs.untyped_data(), m), Vector(group_sizes.untyped_data(), g),
            SmCount(device)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device.
JGM_DEFINE_HANDLERS(JgmGroupedGemmFp8BlockFc1, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Ctx<xla::ffi::DeviceOrdinal>()
                        .Arg<jgm::Fp8>()     // lhs [M, K] f8e4m3fn, K % 16 == 0
                        .Arg<jgm::Fp8>()     // lhs_scale [M, cdiv(K, 128)] f8e8m0fnu
                        .Arg<jgm::Fp8>()     // rhs [G, N, K] f8e4m3fn (K contiguous), N % 8 == 0
                        .Arg<jgm::Fp8>()     // rhs_scale [G, cdiv(N, 128), cdiv(K, 128)] f8e8m0fnu
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device (clamped)
                        .Arg<jgm::F32R1>()   // probs [M]
                        .Ret<jgm::Bf16R2>()  // h [M, N]
                        .Ret<jgm::Fp8>()     // a_row [M, N] f8e4m3fn
                        .Ret<jgm::Fp8>()     // a_row_scale [M, cdiv(N, 128)] f8e8m0fnu
                        .Ret<jgm::Fp8>()     // a_col [M, N] f8e4m3fn
                        .Ret<jgm::Fp8>()     // a_col_scale [cdiv(M, 128) + G, N] f8e8m0fnu
                        .Attr<int32_t>("variant"));
