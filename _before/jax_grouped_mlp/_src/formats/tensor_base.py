"""What the block-scaled tensor types share (``MXFP8Tensor``, ``FP8BlockTensor``).

Both are frozen pytree dataclasses with the fields ``data``, ``scale``, their blocked
axis or axes, ``group_sizes`` and ``rank``. :class:`BlockScaled` adds the behaviour that
depends only on those: ``rank`` filled in from ``data``, and the shape, group-aware and
batch-axis views. It declares no fields, so each type keeps its own field list (and so
its own pytree structure).
"""

from __future__ import annotations

import numpy as np


def ndim_or_none(data) -> int | None:
    """``data.ndim`` of an array-like, None for anything else (checked later)."""
    ndim = getattr(data, "ndim", None)
    return int(ndim) if isinstance(ndim, (int, np.integer)) and not isinstance(ndim, bool) else None


class BlockScaled:
    """Mixin of the block-scaled tensor dataclasses (fields ``data``, ``group_sizes``, ``rank``)."""

    def __post_init__(self):
        # Unflattening passes ``rank`` explicitly (with leaves that may be placeholders),
        # so ``data`` is read only for a tensor built without it.
        if self.rank is None:
            object.__setattr__(self, "rank", ndim_or_none(self.data))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def is_grouped(self) -> bool:
        return self.group_sizes is not None

    @property
    def batch_ndim(self) -> int:
        """Leading batch axes of ``data`` (``data.ndim - rank``; negative where ``vmap``
        or ``scan`` sliced leading axes off)."""
        return 0 if self.rank is None else self.data.ndim - self.rank
