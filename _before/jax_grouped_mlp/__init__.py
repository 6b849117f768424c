"""jax_grouped_mlp: the squared-ReLU MoE expert MLP as one fused, differentiable MXFP8 op.

Public API (everything else lives in ``jax_grouped_mlp._src`` and may change):

* :func:`grouped_mlp` - the op; :func:`offload_policy` - where its residuals live;
  :func:`layer_stack` / :func:`layer_scan` - a loop / a scan of checkpointed layers
  that prefetches their offloaded residuals in the backward pass;
  :func:`layer_scan_host_memory` / :func:`release_layer_scan_host_memory` - the pinned
  host memory ``layer_scan``'s own copies hold on a GPU (:class:`LayerScanHostMemory`);
  :func:`prepare_weights` / :class:`PreparedWeights` - its weights cast and quantized
  once for many micro-batches;
* :func:`quantize_mxfp8`, :func:`quantize_mxfp8_grouped`, :func:`dequantize`,
  :class:`MXFP8Tensor` - the MXFP8 format;
* :func:`quantize_fp8_block`, :func:`dequantize_fp8_block`, :class:`FP8BlockTensor` -
  the FP8 128-block format of ``recipe="fp8_block"``;
* ``RESIDUAL_NAMES`` - the ``checkpoint_name`` tags of the residuals;
  :func:`residual_placements` - where a traced program keeps them;
* :func:`moe_block` - the whole MoE layer (router, top-k, permute, experts, combine),
  with :class:`RoutingConfig`, :class:`ScoreFunction`, and :class:`ExpertParallel` /
  :class:`Exchange` for experts sharded over a mesh axis (docs/moe.md);
  :class:`RouterStats` (its ``return_stats``) and :func:`update_score_bias`;
* :func:`route`, :func:`permute`, :func:`combine`, :class:`Permutation` - the
  block's routing, sort by expert and un-permute, for your own router or experts;
* :func:`plan_offload` - picks the policy from a cost model (docs/offload.md), with
  :class:`OffloadPlan`, :class:`LayerShape`, :class:`LayerTime`, :func:`measure_host_bandwidth` and
  :func:`measure_layer_time`;
* :func:`backend_info` - whether the kernels are built and which path each primitive
  takes on this machine (:class:`BackendInfo`);
* :func:`export_disabled_checks` - pass to ``jax.export.export`` for programs that
  hold our CUDA custom calls;
* ``jax_grouped_mlp.flax`` - Flax NNX modules.
"""

from jax_grouped_mlp._src.moe.exchange import Exchange
from jax_grouped_mlp._src.cuda.ffi import export_disabled_checks
from jax_grouped_mlp._src.offload.measure import measure_host_bandwidth, measure_layer_time
from jax_grouped_mlp._src.op.backend import BackendInfo, backend_info
from jax_grouped_mlp._src.op.mlp import grouped_mlp
from jax_grouped_mlp._src.moe.block import ExpertParallel, moe_block
from jax_grouped_mlp._src.formats.fp8_block import FP8BlockTensor, dequantize_fp8_block, quantize_fp8_block
from jax_grouped_mlp._src.formats.mxfp8 import (
    MXFP8Tensor,
    dequantize,
    quantize_mxfp8,
    quantize_mxfp8_grouped,
)
from jax_grouped_mlp._src.op.names import RESIDUAL_NAMES
from jax_grouped_mlp._src.op.prepared import PreparedWeights, prepare_weights
from jax_grouped_mlp._src.offload.placement import residual_placements
from jax_grouped_mlp._src.offload.planner import LayerShape, LayerTime, OffloadPlan, plan_offload
from jax_grouped_mlp._src.offload.policy import offload_policy
from jax_grouped_mlp._src.offload.host_store import (
    LayerScanHostMemory,
    layer_scan_host_memory,
    release_layer_scan_host_memory,
)
from jax_grouped_mlp._src.offload.scan_stack import layer_scan
from jax_grouped_mlp._src.offload.stack import layer_stack
from jax_grouped_mlp._src.moe.router_stats import RouterStats, update_score_bias
from jax_grouped_mlp._src.moe.routing import Permutation, RoutingConfig, ScoreFunction, combine, permute, route

__all__ = [
    "BackendInfo",
    "Exchange",
    "FP8BlockTensor",
    "ExpertParallel",
    "LayerScanHostMemory",
    "LayerShape",
    "LayerTime",
    "MXFP8Tensor",
    "OffloadPlan",
    "Permutation",
    "PreparedWeights",
    "RESIDUAL_NAMES",
    "RouterStats",
    "RoutingConfig",
    "ScoreFunction",
    "backend_info",
    "combine",
    "dequantize",
    "dequantize_fp8_block",
    "export_disabled_checks",
    "grouped_mlp",
    "layer_scan",
    "layer_scan_host_memory",
    "layer_stack",
    "measure_host_bandwidth",
    "measure_layer_time",
    "moe_block",
    "offload_policy",
    "permute",
    "plan_offload",
    "prepare_weights",
    "quantize_fp8_block",
    "quantize_mxfp8",
    "quantize_mxfp8_grouped",
    "release_layer_scan_host_memory",
    "residual_placements",
    "route",
    "update_score_bias",
]
__version__ = "0.1.0"
