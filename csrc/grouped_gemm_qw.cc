// XLA FFI handler for the Hopper grouped GEMM that quantizes its weight to MXFP8 in the
// kernel (kernels/grouped_gemm_qw_sm90.py), with the token tile chosen on the device.
// Python side: _src/cuda/gemm_ffi.py, grouped_gemm_qw_cuda.
//
//   out[m] = lhs[m] @ fake_quantize(rhs[group(m)]); rows at or past sum(group_sizes) are zero.
//
// Attribute variants: indices into JGM_GROUPED_GEMM_QW_VARIANTS, X(name, rhs_k_major,
// tile_tokens), all of one rhs layout, with distinct token tiles. Each is launched, in
// order, as slot i of the list; `choice` ([2] int32, computed by XLA from the group sizes)
// says which work, read on the device: choice[0] alone (clamped into range), every CTA of
// the others exiting at once, or, with choice[1] == 1 (mixed tiles), all of them, each on
// its band of every group (kernels/tile_scheduler.py, RowBand), from the `lo` and `top`
// this handler passes. So the tiles follow the group sizes without a host
// synchronisation, and the call stays one CUDA-graph node sequence.
#include <algorithm>

#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> a;
  Tensor<3> b;
  Tensor<2> out;
  Tensor<1> group_sizes;
  Tensor<1> choice;
  int32_t slot;
  int32_t count;
  int32_t lo;   // mixed tiles: the largest token tile below this launch's among the launches (0: none)
  int32_t top;  // mixed tiles: 1 for the launch with the largest token tile
  int32_t num_sms;
};
#define JGM_CALL(a, s) a.a, a.b, a.out, a.group_sizes, a.choice, a.slot, a.count, a.lo, a.top, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_GEMM_QW_VARIANTS, "grouped_gemm_qw")
#define JGM_BK(name, k_major, tile) k_major,
const bool kRhsKMajor[] = {JGM_GROUPED_GEMM_QW_VARIANTS(JGM_BK)};
#define JGM_TILE(name, k_major, tile) tile,
const int32_t kTileTokens[] = {JGM_GROUPED_GEMM_QW_VARIANTS(JGM_TILE)};
constexpr size_t kMaxVariants = 8;

using Variants = ffi::Span<const int32_t>;

// Loads every listed variant (the instantiate stage, and a no-op check at execute).
ffi::Error LoadAll(Variants variants) {
  if (variants.size() == 0 || variants.size() > kMaxVariants)
    return ffi::Error::InvalidArgument("grouped_gemm_qw: attribute variants must list 1 to " +
                                       std::to_string(kMaxVariants) + " variants, got " +
                                       std::to_string(variants.size()));
  for (int32_t v : variants)
    if (auto e = kFamily.Load(v); e.failure()) return e;
  for (size_t i = 0; i < variants.size(); ++i) {
    if (kRhsKMajor[variants[i]] != kRhsKMajor[variants[0]])
      return ffi::Error::InvalidArgument(
          "grouped_gemm_qw: attribute variants must share one rhs layout (rhs_k_major)");
    for (size_t j = 0; j < i; ++j)
      if (kTileTokens[variants[i]] == kTileTokens[variants[j]])
        return ffi::Error::InvalidArgument(
            "grouped_gemm_qw: attribute variants must have distinct token tiles (mixed tiles)");
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t device, Bf16R2 lhs, Bf16R3 rhs,
                   S32R1 group_sizes, S32R1 choice, Out<Bf16R2> out, Variants variants) {
  if (auto e = LoadAll(variants); e.failure()) return e;
  const bool k_major = kRhsKMajor[variants[0]];
  const int64_t m = lhs.dimensions()[0], k = lhs.dimensions()[1], g = rhs.dimensions()[0],
                n = rhs.dimensions()[k_major ? 1 : 2];
  auto e = Check("grouped_gemm_qw")
               .Shape("lhs", lhs, "[M, K]", {m, k})
               .Shape("rhs", rhs, k_major ? "[G, N, K]" : "[G, K, N]",
                      {g, k_major ? n : k, k_major ? k : n})
               .Shape("group_sizes", group_sizes, "[G]", {g})
               .Shape("choice", choice, "[2]", {2})
               .Shape("out", *out, "[M, N]", {m, n})
               .Multiple8("K", k).Multiple8("N", n).Result();
  if (e.failure() || m == 0 || n == 0) return e;
  // Every row past the groups (G = 0) or every product empty (K = 0): zeros, no launch (a
  // TMA descriptor cannot have an empty dimension).
  if (g == 0 || k == 0) return Status("grouped_gemm_qw", Zero(stream, *out));
  // rhs is seen as (N, K, G): strides (1, N, K * N), or (K, 1, N * K) when K-major.
  Args args{Matrix(lhs.untyped_data(), m, k),
            Batched(rhs.untyped_data(), n, k, g, k_major ? k : n, k * n),
            Matrix(out->untyped_data(), m, n),
            Vector(group_sizes.untyped_data(), g),
            Vector(choice.untyped_data(), 2),
            0,
            static_cast<int32_t>(variants.size()),
            0,
            0,
            SmCount(device)};
  for (size_t i = 0; i < variants.size(); ++i) {
    args.slot = static_cast<int32_t>(i);
    // This launch's band of the mixed tiles: the next smaller token tile below its own,
    // and whether its tile is the largest (tiles are distinct: LoadAll).
    const int32_t tile = kTileTokens[variants[i]];
    args.lo = 0;
    args.top = 1;
    for (int32_t v : variants) {
      if (kTileTokens[v] < tile) args.lo = std::max(args.lo, kTileTokens[v]);
      if (kTileTokens[v] > tile) args.top = 0;
    }
    if (auto launched = kFamily.Launch(variants[i], args, stream); launched.failure())
      return launched;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jgm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmQwInstantiate, jgm::LoadAll,
                              xla::ffi::Ffi::BindInstantiate().Attr<jgm::Variants>("variants"));
// No host synchronisation: group_sizes and choice stay on the device.
#define JGM_QW_BINDING                                                                   \
  xla::ffi::Ffi::Bind()                                                                  \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                     \
      .Ctx<xla::ffi::DeviceOrdinal>()                                                    \
      .Arg<jgm::Bf16R2>() /* lhs [M, K], K % 8 == 0 */                                   \
      .Arg<jgm::Bf16R3>() /* rhs [G, K, N], N % 8 == 0; [G, N, K] if rhs_k_major */      \
      .Arg<jgm::S32R1>()  /* group_sizes [G], read on the device (clamped) */            \
      .Arg<jgm::S32R1>()  /* choice [2]: the slots that work, read on the device */      \
      .Ret<jgm::Bf16R2>() /* out [M, N] */                                               \
      .Attr<jgm::Variants>("variants")
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmQw, jgm::Execute, JGM_QW_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedGemmQwNoGraph, jgm::Execute, JGM_QW_BINDING);
