// XLA FFI handler for the Hopper grouped GEMM with the FC1 epilogue
// (kernels/grouped_gemm_fc1_sm90.py; Python side: _src/cuda/gemm_ffi.py).
//
//   h[m] = lhs[m] @ rhs[group(m)] (bitwise what jgm_grouped_gemm writes), and from it
//   a = bf16(probs * relu(h)^2) as MXFP8: a_row (rowwise values in bf16), a_col (the
//   group-aware columnwise FP8 copy: E4M3 data + E8M0 scales). The kernel writes only the
//   groups' scale blocks: a_col_scale is cleared here first.
//
// Attribute variant: index into JGM_GROUPED_GEMM_FC1_VARIANTS, X(name).
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> a;
  Tensor<3> b;
  Tensor<2> h, a_row, a_col, a_scale;
  Tensor<1> probs, group_sizes;
  int32_t num_sms;
};
#define JGM_CALL(a, s) \
  a.a, a.b, a.h, a.a_row, a.a_col, a.a_scale, a.probs, a.group_sizes, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_GEMM_FC1_VARIANTS, "grouped_gemm_fc1")

ffi::Error Execute(cudaStream_t stream, int32_t device, Bf16R2 lhs, Bf16R3 rhs,
                   S32R1 group_sizes, F32R1 probs, Out<Bf16R2> h, Out<Bf16R2> a_row,
                   Out<Fp8> a_col, Out<Fp8> a_col_scale, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = lhs.dimensions()[0], k = lhs.dimensions()[1], g = rhs.dimensions()[0],
                n = rhs.dimensions()[2], nb = CeilDiv(m, 32) + g;
  auto e = Check("grouped_gemm_fc1")
               .Shape("lhs", lhs, "[M, K]", {m, k}).Shape("rhs", rhs, "[G, K, N]", {g, k, n})
               .Shape("group_sizes", group_sizes, "[G]", {g}).Shape("probs", probs, "[M]", {m})
               .Shape("h", *h, "[M, N]", {m, n}).Shape("a_row", *a_row, "[M, N]", {m, n})
               .Shape("a_col", *a_col, "[M, N]", {m, n})
               .Type("a_col", a_col->element_type(), ffi::F8E4M3FN)
               .Shape("a_col_scale", *a_col_scale, "[cdiv(M, 32) + G, N]", {nb, n})
               .Type("a_col_scale", a_col_scale->element_type(), ffi::F8E8M0FNU)
               .Multiple8("K", k).Multiple8("N", n).Result();
  if (e.failure()) return e;
  if (auto e = Status("grouped_gemm_fc1", Zero(stream, *a_col_scale)); e.failure()) return e;
  if (m == 0 || n == 0) return ffi::Error::Success();
  // No launch (a TMA descriptor cannot have an empty dimension): zeros. The Python binding
  // computes these static cases in JAX and never gets here; here a_row is +0 where the
  // exact result is bf16(probs * 0) (-0, or NaN for non-finite probs).
  if (g == 0 || k == 0) return Status("grouped_gemm_fc1", Zero(stream, *h, *a_row, *a_col));
  Args args{Matrix(lhs.untyped_data(), m, k), Batched(rhs.untyped_data(), n, k, g, n, k * n),
            Matrix(h->untyped_data(), m, n), Matrix(a_row->untyped_data(), m, n),
            Matrix(a_col->untyped_data(), m, n), Matrix(a_col_scale->untyped_data(), nb, n),
            Vector(probs.untyped_data(), m), Vector(group_sizes.untyped_data(), g),
            SmCount(device)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device.
JGM_DEFINE_HANDLERS(JgmGroupedGemmFc1, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Ctx<xla::ffi::DeviceOrdinal>()
                        .Arg<jgm::Bf16R2>()  // lhs [M, K], K % 8 == 0
                        .Arg<jgm::Bf16R3>()  // rhs [G, K, N], N % 8 == 0
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device (clamped)
                        .Arg<jgm::F32R1>()   // probs [M]
                        .Ret<jgm::Bf16R2>()  // h [M, N]
                        .Ret<jgm::Bf16R2>()  // a_row [M, N]
                        .Ret<jgm::Fp8>()     // a_col [M, N] f8e4m3fn
                        .Ret<jgm::Fp8>()     // a_col_scale [cdiv(M, 32) + G, N] f8e8m0fnu
                        .Attr<int32_t>("variant"));
