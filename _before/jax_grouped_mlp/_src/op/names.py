"""The names of the residuals the backward pass needs (fixed: tests outside the repo use them)."""

from __future__ import annotations

from typing import Final

FC1_INPUT: Final = "fc1_input"  # FC1 input, MXFP8 columnwise (group-aware), for FC1 wgrad
ACTIVATION_INPUT: Final = "activation_input"  # FC1 output before srelu, bf16
FC2_INPUT: Final = "fc2_input"  # srelu output, MXFP8 columnwise (group-aware), for FC2 wgrad
RESIDUAL_NAMES: Final = (FC1_INPUT, ACTIVATION_INPUT, FC2_INPUT)
