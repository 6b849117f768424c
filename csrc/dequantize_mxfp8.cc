// XLA FFI handler for the group-aware columnwise MXFP8 dequantize kernel
// (kernels/dequantize_mxfp8.py; Python side: _src/cuda/ffi.py).
//
//   out = dequantize(MXFP8Tensor(data, scale, axis=0, group_sizes)) in bf16; rows past
//   sum(group_sizes) are zero.
//
// Attribute variant: index into JGM_DEQUANTIZE_VARIANTS, X(name).
#include "jgm_variants.h"

namespace jgm {
namespace {

struct Args {
  Tensor<2> data, scale;
  Tensor<1> group_sizes;
  Tensor<2> out;
};
#define JGM_CALL(a, s) a.data, a.scale, a.group_sizes, a.out, s
JGM_FAMILY(JGM_DEQUANTIZE_VARIANTS, "dequantize_mxfp8")

ffi::Error Execute(cudaStream_t stream, Fp8 data, Fp8 scale, S32R1 group_sizes,
                   Out<Bf16R2> out, int32_t variant) {
  if (auto e = kFamily.Load(variant); e.failure()) return e;
  const int64_t m = Dim(data, 0), k = Dim(data, 1), g = group_sizes.dimensions()[0],
                nb = CeilDiv(m, 32) + g;
  auto e = Check("dequantize_mxfp8")
               .Shape("data", data, "[M, K]", {m, k})
               .Type("data", data.element_type(), ffi::F8E4M3FN)
               .Shape("scale", scale, "[cdiv(M, 32) + G, K]", {nb, k})
               .Type("scale", scale.element_type(), ffi::F8E8M0FNU)
               .Shape("out", *out, "[M, K]", {m, k}).Multiple8("K", k).Result();
  if (e.failure() || m == 0 || k == 0) return e;  // (nothing to write)
  Args args{Matrix(data.untyped_data(), m, k), Matrix(scale.untyped_data(), nb, k),
            Vector(group_sizes.untyped_data(), g), Matrix(out->untyped_data(), m, k)};
  return kFamily.Launch(variant, args, stream);
}

}  // namespace
}  // namespace jgm

// No host synchronisation.
JGM_DEFINE_HANDLERS(JgmDequantize, jgm::kFamily, jgm::Execute,
                    xla::ffi::Ffi::Bind()
                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                        .Arg<jgm::Fp8>()     // data [M, K] f8e4m3fn, K % 8 == 0
                        .Arg<jgm::Fp8>()     // scale [cdiv(M, 32) + G, K] f8e8m0fnu
                        .Arg<jgm::S32R1>()   // group_sizes [G], read on the device
                        .Ret<jgm::Bf16R2>()  // out [M, K]
                        .Attr<int32_t>("variant"));
