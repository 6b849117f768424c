// XLA FFI handler for the Hopper grouped GEMM with the FC2-dgrad (dSReLU) epilogue
// (kernels/grouped_gemm_dgrad_sm90.py; Python side: _src/cuda/gemm_ffi.py).
//
//   da[m] = dy[m] @ w2[group(m)]^T (bf16-rounded exactly as jgm_grouped_gemm's K-major
//   variants, never written), dh = bf16((da * (2 * probs)) * relu(h)) as MXFP8 values in
//   bf16: dh_row (32-blocks along N) and dh_col (group-aware 32-row blocks);
//   dpart[t, m] = sum over column tile t of da * relu(h)^2 (the binding adds the tiles).
// The kernel writes every element of the results (rows past the groups: zeros).
//
// Attribute variant: index into JGM_GROUPED_GEMM_DGRAD_VARIANTS, X(name, tile_n).
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> a;
  Tensor<3> b;
  Tensor<2> h, dh_row, dh_col, dpart;
  Tensor<1> probs, group_sizes;
  int32_t num_sms;
};
#define JGM_CALL(a, s) \
  a.a, a.b, a.h, a.dh_row, a.dh_col, a.dpart, a.probs, a.group_sizes, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_GEMM_DGRAD_VARIANTS, "grouped_gemm_dgrad")
#define JGM_TILE_N(name, tile_n) tile_n,
const int64_t kTileN[] = {JGM_GROUPED_GEMM_DGRAD_VARIANTS(JGM_TILE_N)};

ffi::Error Execute(cudaStream_t stream, int32_t device, Bf16R2 dy, Bf16R3 w2,
                   S32R1 group_sizes, Bf16R2 h, F32R1 probs, Out<Bf16R2> dh_row,
                   Out<Bf16R2> dh_col, Out<F32R2> dpart, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = dy.dimensions()[0], k = dy.dimensions()[1], g = w2.dimensions()[0],
                n = w2.dimensions()[1], nt = CeilDiv(n, kTileN[variant]);
  auto e = Check("grouped_gemm_dgrad")
               .Shape("dy", dy, "[M, K]", {m, k}).Shape("w2", w2, "[G, N, K]", {g, n, k})
               .Shape("group_sizes", group_sizes, "[G]", {g}).Shape("h", h, "[M, N]", {m, n})
               .Shape("probs", probs, "[M]", {m}).Shape("dh_row", *dh_row, "[M, N]", {m, n})
               .Shape("dh_col", *dh_col, "[M, N]", {m, n})
               .Shape("dpart", *dpart, "[cdiv(N, tile_n), M]", {nt, m})
               .Multiple8("K", k).Multiple8("N", n).Result();
  if (e.failure() || m == 0 || n == 0) return e;
  // No launch (a TMA descriptor cannot have an empty dimension): zeros. The Python binding
  // computes these static cases in JAX and never gets here; here the groups' rows are +0
  // where the exact result is bf16(0 * 2 probs * relu(h)) (-0 for negative probs, NaN for
  // non-finite h or probs).
  if (g == 0 || k == 0) return Status("grouped_gemm_dgrad", Zero(stream, *dh_row, *dh_col, *dpart));
  // w2 is seen as (N, K, G) with strides (K, 1, N * K).
  Args args{Matrix(dy.untyped_data(), m, k), Batched(w2.untyped_data(), n, k, g, k, k * n),
            Matrix(h.untyped_data(), m, n), Matrix(dh_row->untyped_data(), m, n),
            Matrix(dh_col->untyped_data(), m, n), Matrix(dpart->untyped_data(), nt, m),
            Vector(probs.untyped_data(), m), Vector(group_sizes.untyped_data(), g),
            SmCount(device)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device.
JGM_DEFINE_HANDLERS(JgmGroupedGemmDgrad, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Ctx<xla::ffi::DeviceOrdinal>()
                        .Arg<jgm::Bf16R2>()  // dy [M, K], K % 8 == 0
                        .Arg<jgm::Bf16R3>()  // w2 [G, N, K], N % 8 == 0 (FC2's [G, F, H] as stored)
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device (clamped)
                        .Arg<jgm::Bf16R2>()  // h [M, N]
                        .Arg<jgm::F32R1>()   // probs [M]
                        .Ret<jgm::Bf16R2>()  // dh_row [M, N]
                        .Ret<jgm::Bf16R2>()  // dh_col [M, N]
                        .Ret<jgm::F32R2>()   // dpart [cdiv(N, tile_n), M], tile_n of the variant
                        .Attr<int32_t>("variant"));
