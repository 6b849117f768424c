// XLA FFI handler for the token-major layout of a group-aware FP8 copy
// (kernels/token_major_blocks.py; Python side: _src/cuda/gemm_ffi.py, token_major_blocks_cuda).
//
//   out[k, 128 b + i] = x[row0(b) + i, k] for i < rows(b), else 0, over the group-aware
//   128-row blocks b of x (numbered as the quantizer numbers its scale rows, from the group
//   sizes clamped to M); the FP8 weight gradient's operand layout.
//
// Attribute variant: index into JGM_TOKEN_MAJOR_BLOCKS_VARIANTS, X(name).
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> x;
  Tensor<1> group_sizes;
  Tensor<2> out;
};
#define JGM_CALL(a, s) a.x, a.group_sizes, a.out, s
JGM_FAMILY(JGM_TOKEN_MAJOR_BLOCKS_VARIANTS, "token_major_blocks")

ffi::Error Execute(cudaStream_t stream, Fp8 x, S32R1 group_sizes, Out<Fp8> out, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = Dim(x, 0), k = Dim(x, 1), g = group_sizes.dimensions()[0],
                p = 128 * (CeilDiv(m, 128) + g);
  auto e = Check("token_major_blocks")
               .Shape("x", x, "[M, K]", {m, k}).Type("x", x.element_type(), ffi::F8E4M3FN)
               .MultipleOf("K", k, 16)
               .Shape("out", *out, "[K, 128 * (cdiv(M, 128) + G)]", {k, p})
               .Type("out", out->element_type(), ffi::F8E4M3FN)
               .Result();
  if (e.failure() || k == 0 || p == 0) return e;  // (nothing to write)
  if (m == 0) return Status("token_major_blocks", Zero(stream, *out));
  Args args{Matrix(x.untyped_data(), m, k), Vector(group_sizes.untyped_data(), g),
            Matrix(out->untyped_data(), k, p)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation: group_sizes stay on the device.
JGM_DEFINE_HANDLERS(JgmTokenMajorBlocks, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Arg<jgm::Fp8>()    // x [M, K] f8e4m3fn, K % 16 == 0
                        .Arg<jgm::S32R1>()  // group_sizes [G], read on the device (clamped)
                        .Ret<jgm::Fp8>()    // out [K, 128 * (cdiv(M, 128) + G)] f8e4m3fn
                        .Attr<int32_t>("variant"));
