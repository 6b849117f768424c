// XLA FFI handler for the Hopper grouped GEMM over ragged M (kernels/grouped_gemm_sm90.py;
// the variant that quantizes the weight in the kernel has its own handler:
// grouped_gemm_qw.cc). Python side: _src/cuda/gemm_ffi.py.
//
//   out[m] = lhs[m] @ rhs[group(m)]; rows at or past sum(group_sizes) are zero.
//
// Attribute variant: index into JGM_GROUPED_GEMM_VARIANTS, X(name, rhs_k_major).
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> a;
  Tensor<3> b;
  Tensor<2> out;
  Tensor<1> group_sizes;
  Tensor<1> tile_counter;
  int32_t num_sms;
};
#define JGM_CALL(a, s) a.a, a.b, a.out, a.group_sizes, a.tile_counter, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_GEMM_VARIANTS, "grouped_gemm")
#define JGM_BK(name, k_major) k_major,
const bool kRhsKMajor[] = {JGM_GROUPED_GEMM_VARIANTS(JGM_BK)};

ffi::Error Execute(cudaStream_t stream, int32_t device, Bf16R2 lhs, Bf16R3 rhs,
                   S32R1 group_sizes, Out<Bf16R2> out, Out<S32R1> tile_counter, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const bool k_major = kRhsKMajor[variant];
  const int64_t m = lhs.dimensions()[0], k = lhs.dimensions()[1], g = rhs.dimensions()[0],
                n = rhs.dimensions()[k_major ? 1 : 2];
  auto e = Check("grouped_gemm")
               .Shape("lhs", lhs, "[M, K]", {m, k})
               .Shape("rhs", rhs, k_major ? "[G, N, K]" : "[G, K, N]",
                      {g, k_major ? n : k, k_major ? k : n})
               .Shape("group_sizes", group_sizes, "[G]", {g}).Shape("out", *out, "[M, N]", {m, n})
               .Shape("tile_counter", *tile_counter, "[1]", {1})
               .Multiple8("K", k).Multiple8("N", n).Result();
  if (e.failure() || m == 0 || n == 0) return e;
  // Every row past the groups (G = 0) or every product empty (K = 0): zeros, no launch (a
  // TMA descriptor cannot have an empty dimension).
  if (g == 0 || k == 0) return Status("grouped_gemm", Zero(stream, *out));
  // rhs is seen as (N, K, G): strides (1, N, K * N), or (K, 1, N * K) when K-major.
#ifdef JGM_DYNAMIC_TILES  // kernels built with the dynamic tile order count tiles from 0
  if (auto err = Zero(stream, *tile_counter)) return Status("grouped_gemm", err);
#endif
  Args args{Matrix(lhs.untyped_data(), m, k),
            Batched(rhs.untyped_data(), n, k, g, k_major ? k : n, k * n),
            Matrix(out->untyped_data(), m, n), Vector(group_sizes.untyped_data(), g),
            Vector(tile_counter->untyped_data(), 1), SmCount(device)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device.
JGM_DEFINE_HANDLERS(JgmGroupedGemm, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Ctx<xla::ffi::DeviceOrdinal>()
                        .Arg<jgm::Bf16R2>()  // lhs [M, K], K % 8 == 0
                        .Arg<jgm::Bf16R3>()  // rhs [G, K, N], N % 8 == 0; [G, N, K] if rhs_k_major
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device (clamped)
                        .Ret<jgm::Bf16R2>()  // out [M, N]
                        .Ret<jgm::S32R1>()   // tile_counter [1]: the dynamic tile order's scratch
                                             // (JGM_DYNAMIC_TILES builds; else unused)
                        .Attr<int32_t>("variant"));
