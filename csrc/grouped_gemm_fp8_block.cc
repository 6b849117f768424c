// XLA FFI handler for the Hopper FP8 block-scaled grouped GEMM over ragged M
// (kernels/grouped_gemm_fp8_block_sm90.py; Python side: _src/cuda/gemm_ffi.py,
// grouped_gemm_fp8_block). Tested on the H200 (tests/test_grouped_gemm_fp8_block_gpu.py).
//
//   out[m] = sum_kb lhs_scale[m, kb] * rhs_scale[g, nb, kb] * (lhs[m, kb] . rhs[g, n, kb])
//   (g = group(m), nb = n / 128, kb = each 128-wide K block); rows at or past
//   sum(group_sizes) are zero.
//
// Attribute variant: index into JGM_GROUPED_GEMM_FP8_BLOCK_VARIANTS, X(name).
#include "fp8_block_operands.h"
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Fp8BlockOperands in;
  Tensor<2> out;
  Tensor<1> group_sizes;
  int32_t num_sms;
};
#define JGM_CALL(a, s) a.in.a, a.in.b, a.in.sa, a.in.sb, a.out, a.group_sizes, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_GEMM_FP8_BLOCK_VARIANTS, "grouped_gemm_fp8_block")

ffi::Error Execute(cudaStream_t stream, int32_t device, Fp8 lhs, Fp8 lhs_scale, Fp8 rhs,
                   Fp8 rhs_scale, S32R1 group_sizes, Out<Bf16R2> out, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const Fp8BlockDims d = Fp8BlockDimsOf(lhs, rhs);
  const int64_t m = d.m, k = d.k, g = d.g, n = d.n;
  Check check("grouped_gemm_fp8_block");
  auto e = CheckFp8BlockOperands(check, d, lhs, lhs_scale, rhs, rhs_scale)
               .Shape("group_sizes", group_sizes, "[G]", {g})
               .Shape("out", *out, "[M, N]", {m, n})
               .Result();
  if (e.failure() || m == 0 || n == 0) return e;
  // Every row past the groups (G = 0) or every product empty (K = 0): zeros, no launch (a
  // TMA descriptor cannot have an empty dimension).
  if (g == 0 || k == 0) return Status("grouped_gemm_fp8_block", Zero(stream, *out));
  Args args{Fp8BlockOperandsOf(d, lhs, lhs_scale, rhs, rhs_scale),
            Matrix(out->untyped_data(), m, n), Vector(group_sizes.untyped_data(), g),
            SmCount(device)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device.
JGM_DEFINE_HANDLERS(JgmGroupedGemmFp8Block, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Ctx<xla::ffi::DeviceOrdinal>()
                        .Arg<jgm::Fp8>()     // lhs [M, K] f8e4m3fn, K % 16 == 0
                        .Arg<jgm::Fp8>()     // lhs_scale [M, cdiv(K, 128)] f8e8m0fnu
                        .Arg<jgm::Fp8>()     // rhs [G, N, K] f8e4m3fn (K contiguous), N % 8 == 0
                        .Arg<jgm::Fp8>()     // rhs_scale [G, cdiv(N, 128), cdiv(K, 128)] f8e8m0fnu
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device (clamped)
                        .Ret<jgm::Bf16R2>()  // out [M, N]
                        .Attr<int32_t>("variant"));
