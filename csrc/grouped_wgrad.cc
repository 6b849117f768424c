// XLA FFI handler for the Hopper grouped weight gradient over ragged M
// (kernels/grouped_wgrad_sm90.py; Python side: _src/cuda/gemm_ffi.py).
//
//   out[g] = lhs_g^T @ rhs_g over group g's rows; empty groups give zeros.
//
// Attribute variant: index into JGM_GROUPED_WGRAD_VARIANTS, X(name, out_type).
// tile_order [1] int32 (computed by XLA from the group sizes, gemm_ffi.wgrad_tile_order):
// non-zero for the dynamic tile order, whose counter (tile_counter) the handler zeroes.
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> a, b;
  Tensor<3> out;
  Tensor<1> group_sizes;
  Tensor<1> tile_counter;
  Tensor<1> tile_order;
  int32_t num_sms;
};
#define JGM_CALL(a, s) a.a, a.b, a.out, a.group_sizes, a.tile_counter, a.tile_order, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_WGRAD_VARIANTS, "grouped_wgrad")
#define JGM_TYPE(name, type) type,
const ffi::DataType kOutType[] = {JGM_GROUPED_WGRAD_VARIANTS(JGM_TYPE)};

ffi::Error Execute(cudaStream_t stream, int32_t device, Bf16R2 lhs, Bf16R2 rhs,
                   S32R1 group_sizes, S32R1 tile_order, Out<ffi::AnyBuffer> out,
                   Out<S32R1> tile_counter, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = lhs.dimensions()[0], k = lhs.dimensions()[1], n = rhs.dimensions()[1],
                g = group_sizes.dimensions()[0];
  auto e = Check("grouped_wgrad")
               .Shape("lhs", lhs, "[M, K]", {m, k}).Shape("rhs", rhs, "[M, N]", {m, n})
               .Shape("out", *out, "[G, K, N]", {g, k, n})
               .Type("out", out->element_type(), kOutType[variant])
               .Shape("tile_order", tile_order, "[1]", {1})
               .Shape("tile_counter", *tile_counter, "[1]", {1})
               .Multiple8("K", k).Multiple8("N", n).Result();
  if (e.failure() || g == 0 || k == 0 || n == 0) return e;
  // No rows: every gradient is zero (a TMA descriptor cannot have an empty dimension).
  if (m == 0) return Status("grouped_wgrad", Zero(stream, *out));
  // lhs as (K, M) strides (1, K); rhs as (N, M) strides (1, N); out as (K, N, G) strides
  // (N, 1, K * N).
  // The dynamic tile order counts tiles from 0 (the static order ignores the counter).
  if (auto err = Zero(stream, *tile_counter)) return Status("grouped_wgrad", err);
  Args args{Matrix(lhs.untyped_data(), k, m, k), Matrix(rhs.untyped_data(), n, m, n),
            Batched(out->untyped_data(), k, n, g, n, k * n),
            Vector(group_sizes.untyped_data(), g), Vector(tile_counter->untyped_data(), 1),
            Vector(tile_order.untyped_data(), 1), SmCount(device)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device.
JGM_DEFINE_HANDLERS(JgmGroupedWgrad, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Ctx<xla::ffi::DeviceOrdinal>()
                        .Arg<jgm::Bf16R2>()          // lhs [M, K], K % 8 == 0
                        .Arg<jgm::Bf16R2>()          // rhs [M, N], N % 8 == 0
                        .Arg<jgm::S32R1>()           // group_sizes [G], read on the device
                        .Arg<jgm::S32R1>()           // tile_order [1], read on the device
                        .Ret<xla::ffi::AnyBuffer>()  // out [G, K, N], bf16 or f32 by variant
                        .Ret<jgm::S32R1>()  // tile_counter [1]: the dynamic tile order's scratch
                        .Attr<int32_t>("variant"));
