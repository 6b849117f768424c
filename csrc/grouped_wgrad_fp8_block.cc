// XLA FFI handler for the Hopper FP8 block-scaled grouped weight gradient
// (kernels/grouped_wgrad_fp8_block_sm90.py; Python side: _src/cuda/gemm_ffi.py,
// grouped_wgrad_fp8_block). Tested on the H200 (tests/test_grouped_wgrad_fp8_block_gpu.py).
//
//   out[g][i, j] = sum over group g's blocks b: lhs_scale[b, i] * rhs_scale[b, j] *
//                  (lhs[i, block b] . rhs[j, block b])
//   (blocks of 128 tokens, numbered as the group-aware quantizer numbers them, from the
//   group sizes clamped to `rows`); empty groups give zeros.
//
// Second result, token [1] int32 (zeroed): exists once the kernel has run. The op's dx
// waits for the weight gradients through it (gemm_ffi.grouped_wgrad_fp8_block with
// with_token=True), so that `out` keeps its one reader and a scan writes it in place.
//
// Attribute variant: index into JGM_GROUPED_WGRAD_FP8_BLOCK_VARIANTS, X(name, out_type);
// attribute rows: M, the token rows of the operands before blocking.
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> a, b, sa, sb;
  Tensor<3> out;
  Tensor<1> group_sizes;
  int32_t rows;
  int32_t num_sms;
};
#define JGM_CALL(a, s) a.a, a.b, a.sa, a.sb, a.out, a.group_sizes, a.rows, a.num_sms, s
JGM_FAMILY(JGM_GROUPED_WGRAD_FP8_BLOCK_VARIANTS, "grouped_wgrad_fp8_block")
#define JGM_TYPE(name, type) type,
const ffi::DataType kOutType[] = {JGM_GROUPED_WGRAD_FP8_BLOCK_VARIANTS(JGM_TYPE)};

constexpr int64_t kBlock = 128;  // tokens per block

ffi::Error Execute(cudaStream_t stream, int32_t device, Fp8 lhs, F32R2 lhs_scale, Fp8 rhs,
                   F32R2 rhs_scale, S32R1 group_sizes, Out<ffi::AnyBuffer> out, Out<S32R1> token,
                   int32_t variant, int64_t rows) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t k = Dim(lhs, 0), n = Dim(rhs, 0), g = group_sizes.dimensions()[0],
                nb = rows < 0 ? -1 : CeilDiv(rows, kBlock) + g, p = nb * kBlock;
  auto e = Check("grouped_wgrad_fp8_block")
               .Shape("lhs", lhs, "[K, 128 * (cdiv(rows, 128) + G)]", {k, p})
               .Type("lhs", lhs.element_type(), ffi::F8E4M3FN)
               .Shape("lhs_scale", lhs_scale, "[cdiv(rows, 128) + G, K]", {nb, k})
               .Shape("rhs", rhs, "[N, 128 * (cdiv(rows, 128) + G)]", {n, p})
               .Type("rhs", rhs.element_type(), ffi::F8E4M3FN)
               .Shape("rhs_scale", rhs_scale, "[cdiv(rows, 128) + G, N]", {nb, n})
               .Shape("out", *out, "[G, K, N]", {g, k, n})
               .Type("out", out->element_type(), kOutType[variant])
               .Shape("token", *token, "[1]", {1})
               .Multiple8("K", k).Multiple8("N", n).Result();
  if (e.failure()) return e;
  if (auto err = Zero(stream, *token)) return Status("grouped_wgrad_fp8_block", err);
  if (g == 0 || k == 0 || n == 0) return e;
  // lhs [K, P] and rhs [N, P] as stored (tokens contiguous); the scales as stored; out
  // [G, K, N] as (K, N, G) strides (N, 1, K * N).
  Args args{Matrix(lhs.untyped_data(), k, p), Matrix(rhs.untyped_data(), n, p),
            Matrix(lhs_scale.untyped_data(), nb, k), Matrix(rhs_scale.untyped_data(), nb, n),
            Batched(out->untyped_data(), k, n, g, n, k * n),
            Vector(group_sizes.untyped_data(), g), I32(rows), SmCount(device)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device. (Handlers spelled out rather
// than JGM_DEFINE_HANDLERS: the instantiate stage must bind the `rows` attribute too.)
#define JGM_WGRAD_FP8_BINDING                                                  \
  xla::ffi::Ffi::Bind()                                                        \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                           \
      .Ctx<xla::ffi::DeviceOrdinal>()                                          \
      .Arg<jgm::Fp8>()             /* lhs [K, P] f8e4m3fn, tokens contiguous */ \
      .Arg<jgm::F32R2>()           /* lhs_scale [NB, K] f32 */                  \
      .Arg<jgm::Fp8>()             /* rhs [N, P] f8e4m3fn, tokens contiguous */ \
      .Arg<jgm::F32R2>()           /* rhs_scale [NB, N] f32 */                  \
      .Arg<jgm::S32R1>()           /* group_sizes [G], read on the device */    \
      .Ret<xla::ffi::AnyBuffer>()  /* out [G, K, N], bf16 or f32 by variant */  \
      .Ret<jgm::S32R1>()           /* token [1] int32, zeroed */                \
      .Attr<int32_t>("variant")                                                \
      .Attr<int64_t>("rows")
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedWgradFp8BlockInstantiate,
                              [](int32_t v, int64_t) { return jgm::kFamily.Load(v); },
                              xla::ffi::Ffi::BindInstantiate()
                                  .Attr<int32_t>("variant")
                                  .Attr<int64_t>("rows"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedWgradFp8Block, jgm::Execute, JGM_WGRAD_FP8_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmGroupedWgradFp8BlockNoGraph, jgm::Execute, JGM_WGRAD_FP8_BINDING);
