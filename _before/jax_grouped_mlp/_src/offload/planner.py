"""``plan_offload``: pick where each residual lives from a small cost model.

Each of the three residuals of :func:`grouped_mlp` ("fc1_input", "activation_input",
"fc2_input") is kept on the device, offloaded to pinned host memory or recomputed in
the backward pass: 27 policies. The planner predicts device memory and step time for
all of them and returns the fastest one that fits a device-memory budget.

Cost model (one layer; ``L`` layers, each under its own ``jax.checkpoint``)
----------------------------------------------------------------------------
Bytes per residual, with ``S = cdiv(M, 32) + G`` rows of E8M0 scales::

    recipe     fc1_input             activation_input   fc2_input
    mxfp8      M*H + S*H  (e4m3+e8m0) 2*M*F  (bf16)      M*F + S*F
    fp8_block  M*H + S'*H             2*M*F              M*F + S'*F   (S' = cdiv(M, 128) + G)
    bf16       2*M*H                  2*M*F              2*M*F

Device memory for residuals::

    memory = L * sum(bytes[r] for r kept on "device")
           + sum(bytes[r] for r not on "device")          # transient: one layer's
                                                          # offloaded/recomputed residuals
                                                          # live again in its backward
    inputs = L * 2*M*H  if "fc1_input" or "activation_input" is "recompute"
                                                          # the layer input x, which the
                                                          # checkpoint keeps only to
                                                          # recompute from it (reported and
                                                          # budgeted with the residuals);
                                                          # 0 for layer="moe_block", which
                                                          # keeps its input in every
                                                          # placement (the router's gradient)

Step time (forward + backward of the stack)::

    transfer  = sum(bytes[r] for r "offload") / host_bandwidth       # each way
    exposed   = max(0, transfer - overlap * forward)                 # device -> host
              + wait                                                 # host -> device
    step_time = L * (forward + backward + sum(recompute[r] for r "recompute") + exposed)

``forward``/``backward`` are one layer's compute with everything on the device, and
``recompute[r]`` the extra backward work to rebuild ``r`` ("fc2_input": srelu and a
quantize from "activation_input"; "activation_input": quantize x and the FC1 grouped
GEMM, ``2*M*H*F`` flops; "fc1_input": quantize x), all from a :class:`LayerTime`.
Expert-parallel ``moe_block`` layers rebuild the op's x for either of the last two by
sending the tokens through the exchange again: :data:`DISPATCH_SHARE` of
``exchange_time`` more, once per layer.
The copy of each layer's residuals to the host finishes within that layer's forward
pass (in a Python loop the op's host-copy fence makes it, on CUDA GPUs and not under
automatic partitioning; in a scan the iteration does) and hides behind that layer's forward compute, of which ``overlap`` (0..1) is
the fraction a copy can hide behind. The copies back start with the layer's backward
pass (``jax.checkpoint``'s default ``prevent_cse=True`` ties them to the layer's
cotangent with an optimization barrier). In a Python loop (``layout="loop"``) both
directions are modelled residual by residual: the copies run one after the other in
the order the layer stored them (``RESIDUAL_NAMES``), a copy out hides only behind the
forward left once its residual exists (:data:`FORWARD_AFTER_READY`: all of it for
"fc1_input", the FC2 half for the other two), a copy back only behind the backward's
compute before its first read (:data:`BACKWARD_BEFORE_USE`: none for
"activation_input", a quarter of the backward for "fc2_input", half for "fc1_input";
the recompute runs first)::

    out  = max over offloaded r of (sum of transfer of r and those stored after it)
                                   - overlap * FORWARD_AFTER_READY[r] * forward
    wait = max over offloaded r of (sum of transfer up to r, in RESIDUAL_NAMES order)
                                   - overlap * (recompute + BACKWARD_BEFORE_USE[r] * backward)
    exposed = out + wait                                  (instead of the line above)

In a ``jax.lax.scan`` (``layout="scan"``) each copy back comes whole before the
iteration's backward (XLA's loop offloading reads it at the iteration's start):
``wait = transfer``.
Under :func:`layer_stack` (``layout="layer_stack"``) a layer's copies out hide behind the
next layer's forward and its copies back behind the next layer's backward (with its
recompute), the last layer offloads nothing, and one more layer's offloaded residuals
count against the device memory::

    exposed   = max(0, transfer - overlap * forward)
              + max(0, transfer - overlap * (backward + recompute))
    step_time = L * (forward + backward + recompute) + (L - 1) * exposed

Under :func:`layer_scan` (``layout="layer_scan"``, on a CUDA GPU: the copies are the
library's own, on streams beside XLA's) the last two layers keep their offloaded
residuals on the device (two more layers' worth count against the device memory) and
each other layer's copies hide as under :func:`layer_stack`: out behind the next
layer's forward, back behind the next layer's backward::

    step_time = L * (forward + backward + recompute) + (L - 2) * exposed   (layer_stack's exposed)

``layout="layer_scan_xla"`` is :func:`layer_scan` with XLA's own host copies (the CPU,
or ``JGM_LAYER_SCAN_STREAMS=0``): they run in the loop's iterations beside the compute
without overlapping it (XLA schedules host-memory slices in loop bodies so; measured
on the H200, docs/offload.md)::

    step_time = L * (forward + backward + recompute) + (L - 2) * 2 * transfer

Until 2026-12-02 the model let both hide behind compute and was 13-37 % optimistic
on the H200; until 2026-12-03 it treated a loop's copies back like a scan's (38-41 %
pessimistic for an offloaded "fc1_input" once the op's fence read its copies back
after the layer's output); measured against it now in docs/offload.md. Not modelled: the first/last layer's edge effects, the weights
(outside the budget), and recompute work that itself hides transfers (conservative).
Measured on the H200 (8 checkpointed layers, all 27
placements): in a ``jax.lax.scan`` the compiled temp memory grows per layer by the kept
residuals plus x exactly when "fc1_input" or "activation_input" is recomputed, within
21 MB of 413 MB; in a Python loop it grows by at most that (XLA puts kept residuals into
weight-gradient buffers not yet written: the model is an upper bound there).

Choice: among the candidates whose memory fits ``budget_bytes``, the smallest step
time; candidates within ``tie_tolerance`` (relative) of it count as tied and the one
with the least host traffic wins, then the least recompute, then the least memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.moe.block import ExpertParallel
from jax_grouped_mlp._src.op.names import ACTIVATION_INPUT, FC1_INPUT, FC2_INPUT, RESIDUAL_NAMES
from jax_grouped_mlp._src.offload.policy import PLACEMENTS, offload_policy

BLOCK = 32  # MXFP8 block: 32 tokens share one e8m0 scale in the columnwise residuals
# Tokens per e8m0 scale of the FP8 columnwise residuals (group-aware blocks), per recipe.
SCALE_BLOCK = {"mxfp8": BLOCK, "fp8_block": 128}
RECIPES = ("mxfp8", "bf16", "fp8_block")

# Ballpark rates of the H200 here (DESIGN.md): an exact MXFP8 grouped GEMM on Hopper
# lands near half the FP8 rate; bf16 grouped GEMMs near 500 TFLOP/s; HBM3e streams
# about 4 TB/s in practice. Used only by :meth:`LayerTime.roofline`.
H200_GEMM_FLOPS = {"mxfp8": 700e12, "bf16": 500e12, "fp8_block": 900e12}
H200_MEMORY_BANDWIDTH = 4.0e12
H200_HOST_BANDWIDTH = 53e9  # pinned host <-> device, each way, measured


# How the checkpointed layers run (``plan_offload(layout=...)``): a Python loop, a
# ``jax.lax.scan``, :func:`layer_stack`, :func:`layer_scan` (its CUDA copies), and
# :func:`layer_scan` with XLA's copies.
LAYOUTS = ("loop", "scan", "layer_stack", "layer_scan", "layer_scan_xla")

# What each checkpointed layer is (``plan_offload(layer=...)``): a ``grouped_mlp`` call,
# whose x is the checkpointed layer's input, or a ``moe_block`` / ``MoEBlock``, which
# keeps its input x in every placement (the router's weight gradient reads it) and
# permutes (under ``parallel``: exchanges) the tokens before its ``grouped_mlp``.
LAYERS = ("grouped_mlp", "moe_block")

# The expert-parallel exchange is four all-to-alls of the same rows per layer (the
# dispatch and the combine, forward, and their transposes, backward). Recomputing
# "fc1_input" or "activation_input" of a ``moe_block`` rebuilds the op's x, the
# dispatched tokens: one more of them (seen in the jaxpr; not measured on a GPU).
DISPATCH_SHARE = 0.25

# The fraction of a layer's backward pass (its GEMMs, in the op's order) that runs
# before each residual is first read: "activation_input" feeds the first kernel (the
# FC2 dgrad with dSReLU fused), "fc2_input" the FC2 weight gradient and "fc1_input" the
# FC1 weight gradient, which XLA schedules after one and two of the four GEMMs at the
# earliest (fitted on the H200: Python loop, expert-parallel Nano share, docs/offload.md).
BACKWARD_BEFORE_USE = {ACTIVATION_INPUT: 0.0, FC2_INPUT: 0.25, FC1_INPUT: 0.5}

# The mirror image for the copies out: the fraction of a layer's forward pass (two
# GEMMs of equal flops) left after each residual exists. "fc1_input" (x quantized)
# exists before FC1, "activation_input" (FC1's output) and "fc2_input" (srelu's output
# quantized, written by FC1's epilogue) only once FC1 is done, so in a Python loop,
# where the op's fence makes the layer's copies out finish within its own forward, their
# copies can hide behind FC2 alone.
FORWARD_AFTER_READY = {FC1_INPUT: 1.0, ACTIVATION_INPUT: 0.5, FC2_INPUT: 0.5}


def _reload_wait(offloaded: list[str], residual_bytes: Mapping[str, int], host_bandwidth: float,
                 backward: float, recompute: float, overlap: float) -> float:  # fmt: skip
    """How long a layer's backward waits for its own copies back (a Python loop of
    checkpointed layers): they start with the layer's backward, tied to its cotangent,
    and run one after the other in the order the layer stored them (``RESIDUAL_NAMES``:
    "fc1_input", "activation_input", "fc2_input"), not the order the backward reads
    them; each hides behind the compute before its first read (the recompute, which
    runs first, and :data:`BACKWARD_BEFORE_USE` of the backward)."""
    wait, arrived = 0.0, 0.0
    for name in sorted(offloaded, key=RESIDUAL_NAMES.index):
        arrived += residual_bytes[name] / host_bandwidth
        wait = max(wait, arrived - overlap * (recompute + BACKWARD_BEFORE_USE[name] * backward))
    return wait


def _copy_out_wait(offloaded: list[str], residual_bytes: Mapping[str, int], host_bandwidth: float,
                   forward: float, overlap: float) -> float:  # fmt: skip
    """How long a layer's forward waits, at its end, for its own copies to the host (a
    Python loop: the op's fence makes them finish within the layer). They run one after
    the other in the order the residuals appear; the copies of the residuals that appear
    at or after ``r`` can hide only behind the forward left after ``r``
    (:data:`FORWARD_AFTER_READY`)."""
    wait, pending = 0.0, 0.0
    for name in reversed(sorted(offloaded, key=RESIDUAL_NAMES.index)):  # the last stored first
        pending += residual_bytes[name] / host_bandwidth
        wait = max(wait, pending - overlap * FORWARD_AFTER_READY[name] * forward)
    return wait


def _check_positive_int(name: str, value) -> int:
    return checks.positive_int(name, value)


def _check_positive_float(
    name: str, value, *, allow_zero: bool = False, allow_inf: bool = False
) -> float:
    return checks.positive_float(name, value, allow_zero=allow_zero, allow_inf=allow_inf)


def _check_recipe(recipe) -> str:
    value = getattr(recipe, "value", recipe)
    if value not in RECIPES:
        raise ValueError(f"recipe must be one of {list(RECIPES)}, got recipe={recipe!r}")
    return value


def _check_layer_shape(shape) -> None:
    # (Defined before LayerShape; looked up when called.)
    if not isinstance(shape, LayerShape):
        raise TypeError(f"shape must be a LayerShape(tokens, hidden, ffn, num_experts), "
                        f"got shape={shape!r} ({type(shape).__name__})")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One grouped-MLP layer: ``tokens`` rows of x (M), ``hidden`` (H), ``ffn`` (F), experts (G)."""

    tokens: int
    hidden: int
    ffn: int
    num_experts: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_positive_int(f.name, getattr(self, f.name))

    def residual_bytes(self, recipe: str) -> dict[str, int]:
        """Bytes of each residual of one layer (see the module docstring)."""
        recipe = _check_recipe(recipe)
        m, h, f = self.tokens, self.hidden, self.ffn
        if recipe == "bf16":
            return {FC1_INPUT: 2 * m * h, ACTIVATION_INPUT: 2 * m * f, FC2_INPUT: 2 * m * f}
        scale_rows = -(-m // SCALE_BLOCK[recipe]) + self.num_experts  # each group pads its tail block
        return {
            FC1_INPUT: m * h + scale_rows * h,
            ACTIVATION_INPUT: 2 * m * f,
            FC2_INPUT: m * f + scale_rows * f,
        }

    @property
    def gemm_flops(self) -> int:
        """Flops of one of the layer's six grouped GEMMs (2 forward, 4 backward)."""
        return 2 * self.tokens * self.hidden * self.ffn


@dataclasses.dataclass(frozen=True)
class LayerTime:
    """Seconds of one layer's compute, everything kept on the device.

    ``recompute`` maps each residual name to the extra backward time its recompute
    costs. Get one from :func:`measure_layer_time` (this device), :meth:`roofline`
    (rates you give) or :meth:`from_total` (one measured fwd+bwd time, split like the
    roofline).
    """

    forward: float
    backward: float
    recompute: Mapping[str, float]

    def __post_init__(self):
        _check_positive_float("forward", self.forward)
        _check_positive_float("backward", self.backward)
        if not isinstance(self.recompute, Mapping):
            raise TypeError(
                f"recompute must be a mapping of {list(RESIDUAL_NAMES)} to seconds, got recompute={self.recompute!r}"
            )
        if set(self.recompute) != set(RESIDUAL_NAMES):
            raise ValueError(
                f"recompute must have exactly the keys {list(RESIDUAL_NAMES)}, "
                f"got recompute={dict(self.recompute)!r}"
            )
        for name, t in self.recompute.items():
            _check_positive_float(f"recompute[{name!r}]", t, allow_zero=True)
        object.__setattr__(self, "recompute", dict(self.recompute))

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def scaled(self, factor: float) -> "LayerTime":
        factor = _check_positive_float("factor", factor)
        return LayerTime(
            self.forward * factor,
            self.backward * factor,
            {k: v * factor for k, v in self.recompute.items()},
        )

    @classmethod
    def roofline(
        cls,
        shape: LayerShape,
        recipe: str = "mxfp8",
        *,
        gemm_flops: float | None = None,
        memory_bandwidth: float = H200_MEMORY_BANDWIDTH,
    ) -> "LayerTime":
        """An estimate from a GEMM rate (flop/s) and a memory bandwidth (bytes/s).

        Six grouped GEMMs of ``2*M*H*F`` flops (two forward, four backward) plus the
        elementwise passes that are not fused into them: quantizing x rowwise and
        columnwise (forward), dy rowwise and columnwise and dh (backward). Defaults
        are the H200 ballpark.
        """
        _check_layer_shape(shape)
        recipe = _check_recipe(recipe)
        flops = H200_GEMM_FLOPS[recipe] if gemm_flops is None else gemm_flops
        flops = _check_positive_float("gemm_flops", flops)
        bw = _check_positive_float("memory_bandwidth", memory_bandwidth)
        m, h, f = shape.tokens, shape.hidden, shape.ffn
        gemm = shape.gemm_flops / flops
        q = 2 if recipe == "bf16" else 1  # bytes written per element by a "quantize"
        quant_x = (2 * m * h + 2 * q * m * h) / bw  # read x, write its two operands
        quant_dy = (2 * m * h + 2 * q * m * h) / bw
        dh = (2 * m * f + 4 * m * f + 2 * q * m * f) / bw  # read h and da, write dh twice
        recompute = {
            FC1_INPUT: (2 * m * h + q * m * h) / bw,
            ACTIVATION_INPUT: gemm + (2 * m * h + q * m * h) / bw,
            FC2_INPUT: (2 * m * f + q * m * f) / bw,
        }
        return cls(2 * gemm + quant_x, 4 * gemm + quant_dy + dh, recompute)

    @classmethod
    def from_total(cls, seconds: float, shape: LayerShape, recipe: str = "mxfp8") -> "LayerTime":
        """One measured forward+backward time, split in the proportions of :meth:`roofline`."""
        seconds = _check_positive_float("seconds", seconds)
        _check_layer_shape(shape)
        est = cls.roofline(shape, recipe)
        return est.scaled(seconds / est.total)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """The predictions for one of the 27 placements (all times per step, in seconds)."""

    placement: Mapping[str, str]
    device_bytes: int  # residual memory on the device at peak
    layer_input_bytes: int  # layer inputs kept on the device only to recompute from them
    host_bytes: int  # residual bytes in pinned host memory
    transfer_bytes: int  # bytes over the link per step, both directions together
    exposed_transfer: float
    recompute: float
    step_time: float
    fits: bool

    def label(self) -> str:
        return "/".join(self.placement[n] for n in RESIDUAL_NAMES)

    @property
    def total_device_bytes(self) -> int:
        """What the budget is held against: residuals plus layer inputs kept for recompute."""
        return self.device_bytes + self.layer_input_bytes


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_time(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What :func:`plan_offload` chose, and why. ``print(plan)`` shows the table."""

    placement: Mapping[str, str]  # residual name -> "device" | "offload" | "recompute"
    shape: LayerShape
    recipe: str
    num_layers: int
    budget_bytes: float
    host_bandwidth: float
    layer_time: LayerTime
    overlap: float
    residual_bytes: Mapping[str, int]  # one layer's, on one device
    candidates: tuple[Candidate, ...]  # sorted by predicted step time
    buffer_rows: int = 0  # rows the residuals are allocated at (the EP receive buffer)
    kept_anyway: frozenset = frozenset()  # residuals that are the layer's input
    exchange_time: float = 0.0  # seconds per layer of the expert-parallel exchange
    layout: str = "loop"  # how the layers run: one of LAYOUTS
    layer: str = "grouped_mlp"  # what each checkpointed layer is: one of LAYERS

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if dict(c.placement) == dict(self.placement))

    @property
    def policy(self):
        """The ``jax.checkpoint`` policy of the chosen placement (:func:`offload_policy`)."""
        return offload_policy(**self.placement)

    @property
    def fuse_fc1_epilogue(self) -> bool:
        """The ``fuse_fc1_epilogue`` to run the layers with under :attr:`policy`: always
        True (kept for compatibility). Recomputing "fc2_input" rebuilds it from
        "activation_input" by one elementwise pass with either FC1 path, as the plan
        costs it, so the fused kernel is never the worse choice.
        """
        return True

    def candidate(self, **placement: str) -> Candidate:
        """The candidate with these placements, e.g. ``candidate(fc1_input="offload", ...)``."""
        for c in self.candidates:
            if dict(c.placement) == placement:
                return c
        raise ValueError(
            f"no candidate with placement {placement!r}: name all of {list(RESIDUAL_NAMES)}, each one of "
            f"{sorted({p for c in self.candidates for p in c.placement.values()})}"
        )

    def table(self, top: int | None = None) -> str:
        """The report as text: inputs, residuals, then candidates (fastest first).

        ``top`` keeps the fastest ``top`` candidates (and the chosen one, wherever it ranks).
        """
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            raise ValueError(f"top must be None or an int >= 0, got top={top!r}")  # (-1 dropped the last row)
        s = self.shape
        lt = self.layer_time
        lines = [
            f"offload plan: M={s.tokens} H={s.hidden} F={s.ffn} G={s.num_experts} "
            f"recipe={self.recipe} layers={self.num_layers} layout={self.layout}"
            + (f" layer={self.layer}" if self.layer != "grouped_mlp" else "")
            + (f" (residuals at {self.buffer_rows} rows: the expert-parallel receive buffer)"
               if self.buffer_rows and self.buffer_rows != s.tokens else "")
            + (f", exchange {_fmt_time(self.exchange_time)}/layer" if self.exchange_time else ""),
            f"  budget {_fmt_bytes(self.budget_bytes)}, host link {_fmt_bytes(self.host_bandwidth)}/s "
            f"each way, layer fwd {_fmt_time(lt.forward)} + bwd {_fmt_time(lt.backward)}, "
            f"overlap {self.overlap:g}",
            "",
            f"  {'residual':<17}{'bytes/layer':>12}{'transfer/way':>14}{'recompute':>12}",
        ]
        for name in RESIDUAL_NAMES:
            b = self.residual_bytes[name]
            lines.append(
                f"  {name:<17}{_fmt_bytes(b):>12}{_fmt_time(b / self.host_bandwidth):>14}"
                f"{_fmt_time(lt.recompute[name]):>12}"
                + ("  (the layer's input: kept on the device anyway)" if name in self.kept_anyway else "")
            )
        lines += [
            "",
            "  fc1_input / activation_input / fc2_input   device mem   host mem"
            "   exposed xfer   recompute   step time  fits",
        ]
        chosen = self.chosen
        rows = list(self.candidates if top is None else self.candidates[:top])
        if chosen not in rows:
            rows += [None, chosen]  # None: a "..." row
        for c in rows:
            if c is None:
                lines.append("  ...")
                continue
            mark = "*" if c is chosen else " "
            lines.append(
                f"{mark} {c.label():<42}{_fmt_bytes(c.total_device_bytes):>11}{_fmt_bytes(c.host_bytes):>11}"
                f"{_fmt_time(c.exposed_transfer):>15}{_fmt_time(c.recompute):>12}"
                f"{_fmt_time(c.step_time):>12}  {'yes' if c.fits else 'no'}"
            )
        lines.append(f"  chosen (*): {chosen.label()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def predict(
    placement: Mapping[str, str],
    *,
    residual_bytes: Mapping[str, int],
    num_layers: int,
    host_bandwidth: float,
    layer_time: LayerTime,
    overlap: float,
    budget_bytes: float = math.inf,
    kept_anyway: frozenset[str] = frozenset(),
    exchange_time: float = 0.0,
    layer_input_bytes: int = 0,
    layout: str = "loop",
    recompute_exchange: float = 0.0,
) -> Candidate:
    """Device memory and step time of one placement (the module docstring's model).

    ``kept_anyway``: residuals that are the checkpointed layer's own input, which the
    checkpoint keeps on the device whatever the policy says (outside the budget, like
    every layer input): they cost no residual memory, and offloading them only adds
    copies. ``exchange_time``: seconds per layer every placement adds (the expert-
    parallel exchange, forward and backward), which host copies do not hide behind.
    ``layer_input_bytes``: one layer's input x (the op's ``x``), which the checkpoint
    keeps on the device when "fc1_input" or "activation_input" is recomputed from it;
    counted against the budget with the residuals (not when "fc1_input" is x itself,
    ``kept_anyway``, where the layer input stays outside the budget).
    ``layout``: how the layers run, one of :data:`LAYOUTS` (the module docstring).
    ``recompute_exchange``: seconds per layer added to the recompute when "fc1_input" or
    "activation_input" is recomputed (an expert-parallel ``moe_block`` dispatches its
    tokens again to rebuild the op's x).
    """
    on = {p: [n for n in RESIDUAL_NAMES if placement[n] == p] for p in PLACEMENTS}
    kept = sum(residual_bytes[n] for n in on["device"] if n not in kept_anyway)
    not_kept = sum(residual_bytes[n] for n in RESIDUAL_NAMES if n not in on["device"] and n not in kept_anyway)
    offloaded = sum(residual_bytes[n] for n in on["offload"])
    # What a layer that keeps its "offload" residuals holds beyond the layer input.
    offloaded_kept = sum(residual_bytes[n] for n in on["offload"] if n not in kept_anyway)
    transfer = offloaded / host_bandwidth
    # To the host: within the layer's own forward pass (the op's host-copy fence in a
    # Python loop, the iteration in a scan). Back: from the start of the layer's
    # backward; in a loop each hides behind the backward before its first read, in a
    # scan none does (measured on the H200).
    recomputes_from_x = placement[FC1_INPUT] == "recompute" or placement[ACTIVATION_INPUT] == "recompute"
    recompute = sum(layer_time.recompute[n] for n in on["recompute"])
    if recomputes_from_x:
        recompute += recompute_exchange
    out = max(0.0, transfer - overlap * layer_time.forward)  # the copies to the host (scan, layer_stack)
    # Copies that run beside the next layer's forward and backward (layer_stack, layer_scan).
    beside_next = out + max(0.0, transfer - overlap * (layer_time.backward + recompute))
    offloading, extra = num_layers, 0
    if layout == "loop":
        on_host = [n for n in RESIDUAL_NAMES if n in on["offload"]]
        exposed = (_copy_out_wait(on_host, residual_bytes, host_bandwidth, layer_time.forward, overlap)
                   + _reload_wait(on_host, residual_bytes, host_bandwidth, layer_time.backward, recompute, overlap))
    elif layout == "scan":
        exposed = out + transfer
    elif layout == "layer_stack":
        # A layer's copies out hide behind the next layer's forward, its copies back
        # behind the next layer's backward; the last layer offloads nothing.
        offloading, extra = num_layers - 1, offloaded_kept
        exposed = beside_next
    else:  # layer_scan, layer_scan_xla: the last two layers keep their offloads on the device
        offloading, extra = max(0, num_layers - 2), min(num_layers, 2) * offloaded_kept
        # The library's own copies hide as under layer_stack; XLA's run inside loop
        # iterations, out and back, next to the compute (measured on the H200).
        exposed = beside_next if layout == "layer_scan" else 2 * transfer
    if offloading == 0:  # every layer keeps its "offload" residuals (extra): none is read back
        not_kept -= offloaded_kept
    device = num_layers * kept + not_kept + extra
    inputs = num_layers * layer_input_bytes if recomputes_from_x and FC1_INPUT not in kept_anyway else 0
    return Candidate(
        placement=dict(placement),
        device_bytes=device,
        layer_input_bytes=inputs,
        host_bytes=offloading * offloaded,
        transfer_bytes=2 * offloading * offloaded,
        exposed_transfer=offloading * exposed,
        recompute=num_layers * recompute,
        step_time=num_layers * (layer_time.total + exchange_time + recompute) + offloading * exposed,
        fits=device + inputs <= budget_bytes,
    )


def plan_offload(
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    num_experts: int,
    num_layers: int,
    budget_bytes: float,
    host_bandwidth: float,
    layer_time: "LayerTime | float",
    recipe: str = "mxfp8",
    overlap: float = 1.0,
    tie_tolerance: float = 0.01,
    parallel: ExpertParallel | None = None,
    exchange_time: float = 0.0,
    fc1_input_is_layer_input: bool | None = None,
    layout: str = "loop",
    layer: str | None = None,
) -> OffloadPlan:
    """Choose where each residual of a stack of grouped-MLP layers lives.

    Predicts device memory and step time for all 27 placements of "fc1_input",
    "activation_input" and "fc2_input" (each "device", "offload" or "recompute") with
    the cost model of :mod:`jax_grouped_mlp._src.offload.planner` (also in docs/offload.md)
    and returns the fastest placement whose residual memory fits ``budget_bytes``.

    Args:
      tokens: M, the rows of x per layer (tokens times top-k).
      hidden, ffn, num_experts: H, F and G of the layer.
      num_layers: layers in the stack, each under its own ``jax.checkpoint``.
      budget_bytes: device memory the residuals of the whole stack may use, with the
        layer inputs kept only to recompute from them (``math.inf``: no limit).
      host_bandwidth: bytes/s each way between device and pinned host memory
        (:func:`measure_host_bandwidth`; about 53e9 on the H200 here).
      layer_time: one layer's compute, a :class:`LayerTime`
        (:func:`measure_layer_time`, :meth:`LayerTime.roofline`) or its forward+backward
        seconds as a float (split like the roofline).
      recipe: "mxfp8", "bf16" or "fp8_block", as given to :func:`grouped_mlp`.
      overlap: fraction (0..1) of a layer's forward compute that its copies to the host
        can hide behind; 1 on a GPU with copy engines, near 0 where copies take the
        compute's cores (CPU). Also the fraction of the backward before a residual's
        first read that its copy back hides behind in a Python loop (the module docstring).
      tie_tolerance: step times within this relative distance of the best count as
        equal; among those the least host traffic wins.
      parallel: the layers' :class:`ExpertParallel` when they run as ``moe_block``
        with experts sharded over a mesh axis. Then ``tokens`` is one device's pairs
        (its token shard times top-k), ``num_experts`` all experts, and the residuals
        are sized as the device's ``grouped_mlp`` allocates them: at its receive
        buffer (``axis_size * tokens`` rows drop-free, ``ceil(capacity_factor *
        tokens)`` with a capacity) with ``num_experts / axis_size`` local experts.
        Budget and memory are per device.
      exchange_time: seconds per layer of the expert-parallel exchange (forward and
        backward together); added to every placement's step time, not hidden by
        host copies. Recomputing "fc1_input" or "activation_input" adds
        :data:`DISPATCH_SHARE` of it (the tokens are dispatched again).
      fc1_input_is_layer_input: whether "fc1_input" is the checkpointed layer's own
        input, which the checkpoint keeps on the device anyway. Default: True for the
        bf16 recipe with ``layer="grouped_mlp"`` (a stack of
        ``jax.checkpoint(grouped_mlp)`` layers: bf16 saves ``x`` itself), else False
        (MXFP8 saves a quantized copy; ``moe_block`` permutes or exchanges the tokens
        first). True needs the bf16 recipe and ``layer="grouped_mlp"``.
      layout: how the layers run. "loop" (default): a Python loop of
        ``jax.checkpoint`` layers (a layer's copies back hide behind the part of its
        own backward before each is read); "scan": ``jax.lax.scan`` / ``nnx.scan`` of
        a checkpointed layer (each copy back exposed); "layer_stack": under
        :func:`layer_stack` (its copies overlap the neighbouring layers, its last layer
        offloads nothing, one more layer's offloaded residuals are on the device);
        "layer_scan": under :func:`layer_scan` on a CUDA GPU (the last two layers
        keep their offloaded residuals on the device; the other layers' copies hide
        as under "layer_stack"); "layer_scan_xla": :func:`layer_scan` with XLA's own
        copies (``JGM_LAYER_SCAN_STREAMS=0``: each way exposed, next to the compute
        inside the loop's iterations).
      layer: what each checkpointed layer is, one of :data:`LAYERS`.
        "grouped_mlp": a ``grouped_mlp`` call; the checkpoint keeps its input x only
        when "fc1_input" or "activation_input" is recomputed from it, so those
        placements are charged ``2 * tokens * hidden`` bytes a layer. "moe_block": a
        ``moe_block`` / :class:`MoEBlock`, which keeps its input in every placement
        (the router's gradient reads it): recomputing costs no memory, and under
        ``parallel`` it dispatches the tokens again. Default: "moe_block" with
        ``parallel``, else "grouped_mlp" (pass "moe_block" for single-device blocks).

    Returns:
      An :class:`OffloadPlan`: ``plan.placement`` (name -> placement), ``plan.policy``
      (for ``jax.checkpoint``) and every candidate's predictions; ``print(plan)``
      shows them as a table.

    Raises:
      ValueError: an argument out of range (the message names it), or no placement
        fits the budget (the message gives the smallest possible memory).
    """
    shape = LayerShape(tokens, hidden, ffn, num_experts)
    _check_positive_int("num_layers", num_layers)
    budget_bytes = _check_positive_float("budget_bytes", budget_bytes, allow_zero=True, allow_inf=True)
    host_bandwidth = _check_positive_float("host_bandwidth", host_bandwidth)
    recipe = _check_recipe(recipe)
    overlap = _check_positive_float("overlap", overlap, allow_zero=True)
    if overlap > 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap=}")
    tie_tolerance = _check_positive_float("tie_tolerance", tie_tolerance, allow_zero=True)
    if isinstance(layer_time, LayerTime):
        lt = layer_time
    elif checks.is_real(layer_time):
        lt = LayerTime.from_total(_check_positive_float("layer_time", layer_time), shape, recipe)
    else:
        raise ValueError(f"layer_time must be a LayerTime or seconds (float), got {layer_time=!r}")

    exchange_time = _check_positive_float("exchange_time", exchange_time, allow_zero=True)
    buffer_rows, local_experts = _device_rows(parallel, tokens, num_experts)
    layer = _check_layer(layer, parallel)
    if fc1_input_is_layer_input is None:
        fc1_input_is_layer_input = recipe == "bf16" and layer == "grouped_mlp"
    elif not isinstance(fc1_input_is_layer_input, bool):
        raise TypeError(f"fc1_input_is_layer_input must be a bool or None, got {fc1_input_is_layer_input!r}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got layout={layout!r}")
    if fc1_input_is_layer_input and recipe != "bf16":
        raise ValueError("fc1_input_is_layer_input=True needs recipe='bf16' (MXFP8 keeps a quantized copy of x)")
    if fc1_input_is_layer_input and layer == "moe_block":
        raise ValueError(
            "fc1_input_is_layer_input=True needs layer='grouped_mlp': a moe_block's fc1_input is its "
            "permuted (or exchanged) tokens, not its input"
        )
    moe = layer == "moe_block"
    kept_anyway = frozenset({FC1_INPUT}) if fc1_input_is_layer_input else frozenset()
    residual_bytes = LayerShape(buffer_rows, hidden, ffn, local_experts).residual_bytes(recipe)
    candidates = [
        predict(
            dict(zip(RESIDUAL_NAMES, combo)),
            residual_bytes=residual_bytes,
            num_layers=num_layers,
            host_bandwidth=host_bandwidth,
            layer_time=lt,
            overlap=overlap,
            budget_bytes=budget_bytes,
            kept_anyway=kept_anyway,
            exchange_time=exchange_time,
            layer_input_bytes=0 if moe else 2 * tokens * hidden,
            layout=layout,
            recompute_exchange=DISPATCH_SHARE * exchange_time if moe else 0.0,
        )
        for combo in itertools.product(PLACEMENTS, repeat=len(RESIDUAL_NAMES))
    ]
    candidates.sort(key=lambda c: (c.step_time, c.transfer_bytes, c.recompute, c.total_device_bytes))
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.total_device_bytes)
        raise ValueError(
            f"no placement fits budget_bytes={budget_bytes:.6g}: the smallest residual "
            f"memory is {least.total_device_bytes} bytes ({_fmt_bytes(least.total_device_bytes)}, "
            f"{least.label()})"
        )
    best_time = fitting[0].step_time
    tied = [c for c in fitting if c.step_time <= best_time * (1 + tie_tolerance)]
    chosen = min(tied, key=lambda c: (c.transfer_bytes, c.recompute, c.total_device_bytes, c.step_time))
    return OffloadPlan(
        placement=dict(chosen.placement),
        shape=shape,
        recipe=recipe,
        num_layers=num_layers,
        budget_bytes=budget_bytes,
        host_bandwidth=host_bandwidth,
        layer_time=lt,
        overlap=overlap,
        residual_bytes=residual_bytes,
        candidates=tuple(candidates),
        buffer_rows=buffer_rows,
        kept_anyway=kept_anyway,
        exchange_time=exchange_time,
        layout=layout,
        layer=layer,
    )


def _check_layer(layer, parallel) -> str:
    """``plan_offload``'s ``layer``, its default filled in from ``parallel``."""
    if layer is None:
        return "grouped_mlp" if parallel is None else "moe_block"
    if not isinstance(layer, str) or layer not in LAYERS:
        raise ValueError(f"layer must be one of {list(LAYERS)} or None, got layer={layer!r}")
    if parallel is not None and layer != "moe_block":
        raise ValueError(f"parallel= plans expert-parallel moe_block layers: layer must be 'moe_block', got {layer=!r}")
    return layer


def _device_rows(parallel, tokens: int, num_experts: int) -> tuple[int, int]:
    """``(rows, experts)`` of one device's ``grouped_mlp``: the layer's own without
    expert parallelism, else its receive buffer and its local experts."""
    if parallel is None:
        return tokens, num_experts
    if not isinstance(parallel, ExpertParallel):
        raise TypeError(f"parallel must be an ExpertParallel or None, got parallel={type(parallel).__name__}")
    ep = parallel.expert_size
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the size of expert_axis={parallel.expert_axis!r} ({ep})"
        )
    rows = ep * tokens
    if parallel.capacity_factor is not None:
        rows = min(rows, max(1, math.ceil(parallel.capacity_factor * tokens)))
    return rows, num_experts // ep
