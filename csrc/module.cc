// The extension module jax_grouped_mlp._kernels: exposes the FFI handlers as capsules.
#include <pybind11/pybind11.h>

#include "jgm_variants.h"

namespace py = pybind11;

// The jaxlib whose FFI headers this extension was compiled against (tools/build_kernels.py
// defines it). XLA may silently refuse handlers built against another jaxlib, so the
// loader compares it with the running one; the marker lets the build read it from the file.
#ifndef JGM_JAXLIB_VERSION
#define JGM_JAXLIB_VERSION "unknown"
#endif
static const char kBuiltAgainst[] = "jgm-built-against-jaxlib:" JGM_JAXLIB_VERSION;

namespace {

py::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

py::tuple Names(std::initializer_list<const char*> names) {
  py::list out;
  for (const char* name : names) out.append(name);
  return py::tuple(out);
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "AOT-compiled CuTe DSL kernels for jax_grouped_mlp, as XLA FFI handlers.";
  m.def("captured_launches", [] { return jgm::g_captured_launches.load(); },
        "Kernel launches recorded into CUDA graphs (XLA command buffers) by this process.");
  m.def(
      "host_store_memory",
      [] {
        jgm::HostStoreMemory s = jgm::HostStoreStats();
        py::dict d;
        d["in_use_bytes"] = s.in_use_bytes;
        d["in_use_entries"] = s.in_use_entries;
        d["idle_bytes"] = s.idle_bytes;
        d["idle_entries"] = s.idle_entries;
        return d;
      },
      "Pinned host memory layer_scan's host store holds: on stacks (in use) and idle.");
  m.def(
      "host_store_release",
      [] {
        int64_t released = 0;
        cudaError_t err;
        {
          py::gil_scoped_release unlocked;  // it waits for copies to finish
          err = jgm::HostStoreRelease(&released);
        }
        if (err != cudaSuccess)
          throw std::runtime_error(std::string("host_store_release: ") + cudaGetErrorString(err));
        return released;
      },
      "Frees the host store's idle pinned entries (their copies done first); returns the bytes freed.");
  m.def(
      "registrations",
      [](bool cuda_graphs) {
        py::dict d;
        auto add = [&](const char* target, auto* instantiate, auto* graph, auto* no_graph) {
          py::dict handlers;
          handlers["instantiate"] = Capsule(instantiate);
          handlers["execute"] = Capsule(cuda_graphs ? graph : no_graph);
          d[target] = handlers;
        };
#define JGM_ADD(target, Sym) add(target, Sym##Instantiate, Sym, Sym##NoGraph)
        JGM_ADD("jgm_fake_quantize_mxfp8", JgmFakeQuantize);
        JGM_ADD("jgm_fake_quantize_pair", JgmFakeQuantizePair);
        JGM_ADD("jgm_dequantize_mxfp8", JgmDequantize);
        JGM_ADD("jgm_grouped_gemm", JgmGroupedGemm);
        JGM_ADD("jgm_grouped_gemm_qw", JgmGroupedGemmQw);
        JGM_ADD("jgm_grouped_wgrad", JgmGroupedWgrad);
        JGM_ADD("jgm_grouped_gemm_fc1", JgmGroupedGemmFc1);
        JGM_ADD("jgm_grouped_gemm_dgrad", JgmGroupedGemmDgrad);
        JGM_ADD("jgm_grouped_gemm_fp8_block", JgmGroupedGemmFp8Block);
        JGM_ADD("jgm_grouped_gemm_fp8_block_fc1", JgmGroupedGemmFp8BlockFc1);
        JGM_ADD("jgm_quantize_fp8_block_pair", JgmQuantizeFp8BlockPair);
        JGM_ADD("jgm_quantize_fp8_block", JgmQuantizeFp8Block);
        JGM_ADD("jgm_grouped_wgrad_fp8_block", JgmGroupedWgradFp8Block);
        JGM_ADD("jgm_token_major_blocks", JgmTokenMajorBlocks);
        for (auto [target, execute] : {std::pair{"jgm_host_put_start", JgmHostPutStart},
                                       std::pair{"jgm_host_put_done", JgmHostPutDone},
                                       std::pair{"jgm_host_get_start", JgmHostGetStart},
                                       std::pair{"jgm_host_get_done", JgmHostGetDone},
                                       std::pair{"jgm_empty", JgmEmpty}}) {
          py::dict handlers;  // execute only, never command-buffer compatible (host state;
                              // jgm_empty, a no-op, is kept with them: outside graphs too)
          handlers["execute"] = Capsule(execute);
          d[target] = handlers;
        }
        return d;
      },
      py::arg("cuda_graphs") = true,
      "Target name -> {stage: handler capsule}. cuda_graphs=False gives execute handlers "
      "not marked command-buffer compatible (XLA then runs them outside CUDA graphs).");
#define JGM_NAMES(list) m.attr(#list) = Names({JGM_##list(JGM_VARIANT_NAME)})
  JGM_NAMES(FAKE_QUANTIZE_VARIANTS);
  JGM_NAMES(DEQUANTIZE_VARIANTS);
  JGM_NAMES(FAKE_QUANTIZE_PAIR_VARIANTS);
  JGM_NAMES(GROUPED_GEMM_VARIANTS);
  JGM_NAMES(GROUPED_GEMM_QW_VARIANTS);
  JGM_NAMES(GROUPED_WGRAD_VARIANTS);
  JGM_NAMES(GROUPED_GEMM_FC1_VARIANTS);
  JGM_NAMES(GROUPED_GEMM_DGRAD_VARIANTS);
  JGM_NAMES(GROUPED_GEMM_FP8_BLOCK_VARIANTS);
  JGM_NAMES(GROUPED_GEMM_FP8_BLOCK_FC1_VARIANTS);
  JGM_NAMES(QUANTIZE_FP8_BLOCK_PAIR_VARIANTS);
  JGM_NAMES(QUANTIZE_FP8_BLOCK_VARIANTS);
  JGM_NAMES(GROUPED_WGRAD_FP8_BLOCK_VARIANTS);
  JGM_NAMES(TOKEN_MAJOR_BLOCKS_VARIANTS);
  m.attr("ARCH") = "sm_90a";
  m.attr("JAXLIB_VERSION") = JGM_JAXLIB_VERSION;
#ifdef JGM_DYNAMIC_TILES  // the experimental dynamic tile orders (tools/build_kernels.py SWITCHES)
  m.attr("DYNAMIC_TILES") = true;
#else
  m.attr("DYNAMIC_TILES") = false;
#endif
  m.attr("BUILT_AGAINST") = kBuiltAgainst;
}
