"""The persistent tile scheduler of the ragged grouped GEMMs: one small cursor object.

Work decomposition ("segments", see :mod:`grouped_gemm_sm90`): segment ``g < G`` is
group ``g``'s rows (sizes clamped so every segment lies inside ``[0, M)``), segment ``G``
the rows past ``sum(group_sizes)``. Each segment is cut into row tiles of ``seg_tile``
that never cross its end, times ``n_tiles`` column tiles, numbered segment by segment and,
inside a segment, in panels of ``panel_m`` row tiles (column tile outer). CTA ``b`` of a
persistent grid of ``gdim`` takes tiles ``b, b + gdim, ...`` (static order), or, with a
:class:`TileHandoff`, tile ``b`` and then whichever tile a global atomic counter hands it
next (dynamic order: the running tiles stay a contiguous window whatever each costs).

:class:`SegmentTileScheduler` is that walk for one warp role: the current tile ``t`` and
the forward-only cursor over the segments (one ``group_sizes`` load per group boundary
passed), so no role needs a prefix sum, a workspace or another role's help. Only the
cursor's dynamic state travels through the tile loop (``__extract_mlir_values__``:
``t`` and the segment fields, in the order the kernels carried them as loose scalars, so
the emitted code is the one they had); the problem (``group_sizes``, ``m``, ``n_tiles``,
``gdim``) and the tiling constants ride along at trace time.

Several launches of one call may share the segments (a :class:`RowBand` each: the
``_qw`` GEMM's mixed tiles): each launch then takes only its rows of every segment
(:meth:`RowBand.extent`), and the launches together take every row once.

``blocks=True`` also carries ``blk0``: the number of 32-row MXFP8 blocks of all earlier
segments (the FC1 epilogue's scale row of a tile's first block); ``blocks=128`` counts
128-row blocks instead (the ``fp8_block`` FC1 epilogue: a tile is then one block).
"""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

BIG = 1 << 30  # "infinitely many tiles": stops the cursor past the tail segment
BLOCK = 32  # MXFP8 block rows (``blocks=True``)


class RowBand:
    """Which rows of every segment a launch takes when several launches of one call share
    the segments (the ``_qw`` GEMM's mixed tiles, ``mixed`` == 1): each group is cut into
    whole chunks of ``chunk`` rows and a remainder ``r < chunk``. The launch with the
    largest tile (``top`` == 1) takes the chunks, a remainder with ``r > lo`` and the rows
    past the groups; any other launch (token tile ``tile``) takes only a remainder with
    ``lo < r <= tile``. With ``lo`` the next smaller tile among the launches that work (0
    for the smallest), every row is taken by exactly one launch, and (where the largest
    tile holds a chunk) each remainder is one tile of the smallest tile that holds it.
    ``mixed`` != 1: whole segments.

    ``chunk`` and ``tile`` are trace-time ints; ``mixed``, ``lo`` and ``top`` run-time Int32
    set once per launch (loop-invariant, so they ride along at trace time)."""

    def __init__(self, chunk: int, tile: int, mixed, lo, top):
        self.chunk, self.tile = chunk, tile
        self.mixed, self.lo, self.top = mixed, lo, top

    def extent(self, rows, in_group) -> tuple:
        """``(first row, rows)`` this launch takes of a segment of ``rows`` rows
        (``in_group``: a group, not the tail). Selects only, no branches."""
        full = cutlass.select_(in_group, rows // self.chunk * self.chunk, Int32(0))
        r = rows - full
        fits = cutlass.select_(r <= self.tile, Int32(1), Int32(0))
        in_band = cutlass.select_(r > self.lo, cutlass.select_(self.top == 1, Int32(1), fits), Int32(0))
        rem = r * in_band
        top = self.top == 1
        first = cutlass.select_(top, Int32(0), full)
        length = cutlass.select_(in_group, cutlass.select_(top, full + rem, rem), cutlass.select_(top, rows, Int32(0)))
        mixed = self.mixed == 1
        return cutlass.select_(mixed, first, Int32(0)), cutlass.select_(mixed, length, rows)


@cute.jit
def segment_rows(group_sizes: cute.Tensor, seg: Int32, row0: Int32, m: Int32) -> Int32:
    """Rows of segment ``seg`` starting at ``row0`` (clamped to M; tail = the rest)."""
    num_groups = group_sizes.shape[0]
    rows = Int32(0)
    if seg < num_groups:
        rows = cutlass.min(cutlass.max(Int32(group_sizes[seg]), Int32(0)), m - row0)
    elif seg == num_groups:
        rows = m - row0
    return rows


class TraceTimeObject:
    """Base of the kernels' trace-time helper objects (mainloops, epilogues, :class:`TileWork`):
    a ``while`` of the DSL carries every object whose method its body calls, so these say
    that they carry no run-time value (their tensors and copies are set up before the
    loop and only read in it)."""

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self


HANDOFF_SLOTS = 4  # tile indices in flight from the producer warp to the consumer warp groups


class TileHandoff(TraceTimeObject):
    """The dynamic tile order of a persistent kernel, one side of it: the producer warp
    takes each next tile from a global counter (zeroed before the launch; tile
    ``gdim + ticket``, after every CTA's static first tile ``bidx``) and hands its index to
    the consumer warp groups through ``HANDOFF_SLOTS`` shared-memory slots (``ring``, with
    the ``pipe`` of full and empty barriers: 32 producer arrivals, 256 consumer ones).

    Tickets only grow, so each role's tiles come in increasing order and the
    :class:`SegmentTileScheduler` cursor, which only moves forward, works unchanged. The
    result does not depend on which CTA takes a tile (each tile is computed whole by one
    CTA), so the output stays bitwise deterministic. ``n``: the handoffs this role has
    made so far (the scheduler's ``handoff`` field).

    The producer claims a tile's successor when it starts the tile (:meth:`claim`) and
    reads the ticket only when it hands the successor over, after the tile's loads: the
    atomic's round trip to L2 overlaps those loads instead of stalling the producer
    between tiles (a weight-gradient tile has as few as 6 stages). Every claimed ticket
    is handed over, so no tile is lost."""

    def __init__(self, counter: cute.Tensor, ring: cute.Tensor, pipe, gdim, producer: bool, dynamic=None):
        self.counter = counter
        self.ring = ring
        self.pipe = pipe
        self.gdim = gdim
        self.producer = producer
        self.dynamic = dynamic  # None: always the counter; else a runtime Boolean (producer)

    def choosing(self, dynamic) -> "TileHandoff":
        """This role's handoff that is used only where the runtime Boolean ``dynamic``
        holds (tickets from the counter, indices through the ring); otherwise the role
        follows the static order by itself, with no ring traffic (``dynamic`` must be the
        same for every role of every CTA: XLA's choice, read from global memory)."""
        return TileHandoff(self.counter, self.ring, self.pipe, self.gdim, self.producer, dynamic)

    @cute.jit
    def claim(self) -> Int32:
        """The producer's next ticket, claimed now (:meth:`_take_ticket`; 0 in the static
        order): pass it to :meth:`next_tile`, whose shuffle is the first read of it."""
        ticket = Int32(0)
        if cutlass.const_expr(self.dynamic is None):
            ticket = self._take_ticket()
        else:
            if self.dynamic:
                ticket = self._take_ticket()
        return ticket

    @cute.jit
    def _take_ticket(self) -> Int32:
        """Lane 0's atomic increment of the counter (the other lanes hold 0)."""
        ticket = Int32(0)
        if cute.arch.lane_idx() == 0:
            ticket = Int32(cute.arch.atomic_add(self.counter.iterator, Int32(1)))
        return ticket

    @cute.jit
    def next_tile(self, n: Int32, claimed: Int32 | None = None, static_t: Int32 | None = None) -> Int32:
        """This role's next tile (handoff ``n``): through the ring (:meth:`_exchange`), or,
        for a :meth:`choosing` handoff in the static order, ``static_t``."""
        t = Int32(0)
        if cutlass.const_expr(self.dynamic is None):
            t = self._exchange(n, claimed)
        else:
            t = static_t
            if self.dynamic:
                t = self._exchange(n, claimed)
        return t

    @cute.jit
    def _exchange(self, n: Int32, claimed: Int32 | None) -> Int32:
        """Handoff ``n`` through the ring: the producer publishes the ticket it ``claimed``
        (:meth:`claim`) as a tile index; the consumers wait for it and read it."""
        slot = n % HANDOFF_SLOTS
        lap = (n // HANDOFF_SLOTS) % 2
        t = Int32(0)
        if cutlass.const_expr(self.producer):
            t = Int32(cute.arch.shuffle_sync(claimed, offset=0)) + self.gdim
            state = pipeline.PipelineState(HANDOFF_SLOTS, n, slot, lap ^ 1)
            self.pipe.producer_acquire(state)
            self.ring[slot] = t
            self.pipe.producer_commit(state)
        else:
            state = pipeline.PipelineState(HANDOFF_SLOTS, n, slot, lap)
            self.pipe.consumer_wait(state)
            t = self.ring[slot]
            self.pipe.consumer_release(state)
        return t


class LoopCursor:
    """What the two scheduler cursors share: the DSL value protocol (only the fields named
    in ``_DYNAMIC`` that are not None travel through a tile loop; the rest ride along at
    trace time) and the dynamic order's plumbing (``source``: this role's
    :class:`TileHandoff` or None; ``handoff``: the handoffs it has made so far)."""

    _DYNAMIC: tuple = ()
    source: "TileHandoff | None" = None
    handoff = None

    def _fields(self):
        return [f for f in self._DYNAMIC if getattr(self, f, None) is not None]

    def __extract_mlir_values__(self):
        values = []
        for f in self._fields():
            values += extract_mlir_values(getattr(self, f))
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        for f, v in zip(self._fields(), values, strict=True):
            setattr(new, f, new_from_mlir_values(getattr(self, f), [v]))
        return new

    def claim(self):
        """The producer's claim on its next tile (:meth:`TileHandoff.claim`), made when a
        tile starts and passed to ``advance``; None (trace time) for the static order."""
        return None if self.source is None else self.source.claim()

    def _handed(self, moved: "LoopCursor") -> "LoopCursor":
        """``moved`` (the cursor at the tile the handoff gave) with one more handoff counted."""
        moved.handoff = self.handoff + 1
        return moved


class SegmentTileScheduler(LoopCursor):
    """This role's tile ``t`` and the segment cursor ``(seg, tile0, row0, rows, tiles[, blk0])``:
    tile ``t`` lies in segment ``seg``, whose first tile is ``tile0``, first row ``row0``,
    with ``rows`` rows and ``tiles`` tiles (:data:`BIG` past the tail).

    Immutable in use: :meth:`advance` returns the next position (the tile loops rebind it).
    With a :class:`TileHandoff` (``source``) the next tile comes from it, and ``handoff``
    counts the tiles it has handed this role so far.

    ``band``: the rows of every segment this launch takes (:class:`RowBand`; None: all);
    ``rows`` stays the whole segment's (the cursor's row arithmetic), ``tiles`` counts the
    band's tiles, and :meth:`tile_coords` offsets the rows into the band.
    """

    _DYNAMIC = ("t", "seg", "tile0", "row0", "rows", "tiles", "blk0", "handoff")

    def __init__(self, group_sizes: cute.Tensor, m, n_tiles, gdim, seg_tile: int, panel_m: int,
                 t, seg, tile0, row0, rows, tiles, blk0=None, block_rows: int = BLOCK,
                 handoff=None, source: "TileHandoff | None" = None, band: "RowBand | None" = None):
        self.band = band  # trace time: None (whole segments) or this launch's RowBand
        self.block_rows = block_rows  # rows per counted block (blk0), trace time
        self.source = source  # trace time: None (static order) or this role's TileHandoff
        self.handoff = handoff
        self.group_sizes = group_sizes
        self.m = m
        self.n_tiles = n_tiles
        self.gdim = gdim
        self.seg_tile = seg_tile
        self.panel_m = panel_m
        self.t, self.seg, self.tile0, self.row0, self.rows, self.tiles, self.blk0 = (
            t, seg, tile0, row0, rows, tiles, blk0
        )

    # ---- construction and movement ----

    @staticmethod
    def segment_tiles(group_sizes: cute.Tensor, seg, rows, n_tiles, seg_tile: int, band: "RowBand | None" = None):
        """Tiles of segment ``seg`` (``rows`` rows) that this launch takes."""
        if cutlass.const_expr(band is not None):
            _, rows = band.extent(rows, seg < group_sizes.shape[0])
        return (rows + (seg_tile - 1)) // seg_tile * n_tiles

    @staticmethod
    def first_segment(group_sizes: cute.Tensor, m, n_tiles, seg_tile: int, band: "RowBand | None" = None):
        """``(rows, tiles)`` of segment 0 (the tail directly when G == 0): the cursor's start,
        computed once per CTA and shared by its roles."""
        rows = segment_rows(group_sizes, Int32(0), Int32(0), m)
        return rows, SegmentTileScheduler.segment_tiles(group_sizes, Int32(0), rows, n_tiles, seg_tile, band)

    @staticmethod
    def create(group_sizes: cute.Tensor, m, n_tiles, bidx, gdim, seg_tile: int, panel_m: int, seg0,
               blocks: bool | int = False, source: "TileHandoff | None" = None,
               band: "RowBand | None" = None) -> "SegmentTileScheduler":
        """The cursor at this CTA's first tile ``bidx``; ``seg0`` from :meth:`first_segment`.
        ``blocks``: count blocks of :data:`BLOCK` rows (True) or of that many rows (an int).
        ``source``: this role's :class:`TileHandoff` (dynamic order), None for the static one.
        ``band``: the rows of every segment the launch takes (None: all)."""
        start = SegmentTileScheduler(
            group_sizes, m, n_tiles, gdim, seg_tile, panel_m, Int32(bidx), Int32(0), Int32(0), Int32(0),
            seg0[0], seg0[1], Int32(0) if blocks else None, BLOCK if blocks is True else int(blocks or BLOCK),
            Int32(0) if source is not None else None, source, band,
        )
        return start._seek(start.t)

    @cute.jit
    def _seek(self, t) -> "SegmentTileScheduler":
        """The cursor moved forward until tile ``t`` lies in segment ``seg`` (or past the tail)."""
        group_sizes, m, n_tiles = self.group_sizes, self.m, self.n_tiles
        num_groups = group_sizes.shape[0]
        seg, seg_tile0, seg_row0, seg_rows, seg_tiles = self.seg, self.tile0, self.row0, self.rows, self.tiles
        seg_blk0 = self.blk0
        if cutlass.const_expr(seg_blk0 is None):
            while t - seg_tile0 >= seg_tiles:
                seg_tile0 = seg_tile0 + seg_tiles
                seg_row0 = seg_row0 + seg_rows
                seg = seg + 1
                seg_rows = segment_rows(group_sizes, seg, seg_row0, m)
                seg_tiles = self._tiles_of(seg, seg_rows)
                if seg > num_groups:
                    seg_tiles = Int32(BIG)
        else:
            while t - seg_tile0 >= seg_tiles:
                seg_tile0 = seg_tile0 + seg_tiles
                seg_row0 = seg_row0 + seg_rows
                seg_blk0 = seg_blk0 + (seg_rows + (self.block_rows - 1)) // self.block_rows
                seg = seg + 1
                seg_rows = segment_rows(group_sizes, seg, seg_row0, m)
                seg_tiles = self._tiles_of(seg, seg_rows)
                if seg > num_groups:
                    seg_tiles = Int32(BIG)
        return SegmentTileScheduler(
            group_sizes, m, n_tiles, self.gdim, self.seg_tile, self.panel_m, t, seg, seg_tile0, seg_row0,
            seg_rows, seg_tiles, seg_blk0, self.block_rows, self.handoff, self.source, self.band,
        )

    def _tiles_of(self, seg, rows):
        """Tiles of segment ``seg`` with ``rows`` rows that this launch takes."""
        return self.segment_tiles(self.group_sizes, seg, rows, self.n_tiles, self.seg_tile, self.band)

    def advance(self, tile=None, claimed=None) -> "SegmentTileScheduler":
        """The cursor at this CTA's next tile: ``t + gdim``, or the :class:`TileHandoff`'s
        next one (the producer's from its ``claimed`` ticket; ``tile``, the current tile's
        coordinates, is not needed here)."""
        if self.source is None:
            return self._seek(self.t + self.gdim)
        return self._handed(self._seek(self.source.next_tile(self.handoff, claimed)))

    # ---- the current tile ----

    def valid(self):
        """Whether the current tile exists (the tile loops' condition)."""
        return self.seg <= self.group_sizes.shape[0]

    def in_group(self):
        """Whether the current tile holds group rows (not the tail past ``sum(group_sizes)``)."""
        return self.seg < self.group_sizes.shape[0]

    @cute.jit
    def tile_coords(self):
        """``(row offset in the segment, rows valid, column tile)`` of the current tile."""
        local = self.t - self.tile0
        first, rows = Int32(0), self.rows
        if cutlass.const_expr(self.band is not None):
            first, rows = self.band.extent(self.rows, self.in_group())
        m_tiles = (rows + (self.seg_tile - 1)) // self.seg_tile
        panel_tiles = self.panel_m * self.n_tiles
        panel = local // panel_tiles
        r = local - panel * panel_tiles
        rows_in_panel = cutlass.min(Int32(self.panel_m), m_tiles - panel * self.panel_m)
        n_tile = r // rows_in_panel
        m_tile = panel * self.panel_m + (r - n_tile * rows_in_panel)
        row_off = m_tile * self.seg_tile
        return first + row_off, cutlass.min(rows - row_off, Int32(self.seg_tile)), n_tile


class TileWork(TraceTimeObject):
    """One CTA's share of a ragged grouped GEMM, as the kernel body sets it up for its roles:
    the problem (``group_sizes``, ``m`` ragged rows, ``n_tiles`` column tiles, ``k_tiles``
    pipeline stages per tile), the persistent grid (``bidx`` of ``gdim``), the tiling
    (``seg_tile`` rows per tile, ``panel_m``) and segment 0 (``seg0``,
    :meth:`SegmentTileScheduler.first_segment`) and, for the dynamic order, the consumers'
    :class:`TileHandoff`, and the rows of every segment the launch takes (``band``,
    :class:`RowBand`; None: all). Trace-time only: never loop-carried."""

    def __init__(self, group_sizes: cute.Tensor, m, n_tiles, k_tiles, bidx, gdim, seg_tile: int, panel_m: int, seg0,
                 source: "TileHandoff | None" = None, band: "RowBand | None" = None):
        self.band = band
        self.source = source  # the consumers' TileHandoff (dynamic order), or None
        self.group_sizes = group_sizes
        self.m = m
        self.n_tiles = n_tiles
        self.k_tiles = k_tiles
        self.bidx = bidx
        self.gdim = gdim
        self.seg_tile = seg_tile
        self.panel_m = panel_m
        self.seg0 = seg0

    def scheduler(self, blocks: bool | int = False):
        """A role's scheduler at this CTA's first tile (``blocks``: also count blocks,
        :meth:`SegmentTileScheduler.create`)."""
        return SegmentTileScheduler.create(
            self.group_sizes, self.m, self.n_tiles, self.bidx, self.gdim, self.seg_tile, self.panel_m, self.seg0,
            blocks=blocks, source=self.source, band=self.band,
        )


class GroupTileScheduler(LoopCursor):
    """The weight-gradient kernel's walk: every group has the same ``group_tiles`` output
    tiles (``m_tiles`` row tiles x column tiles, row tile inner), numbered group by group;
    CTA ``b`` takes tiles ``b, b + gdim, ...`` below ``num_groups * group_tiles``. The
    cursor ``(g, start, size)`` (the group of the last located tile, its first row and its
    clamped size) moves forward only: one ``group_sizes`` load per group passed.

    Same use as :class:`SegmentTileScheduler`: ``while sched.valid()``, ``tile_coords()``,
    ``advance(tile)``. Here :meth:`tile_coords` moves the cursor to the tile's group (the
    moved cursor is the tile's first element) and :meth:`advance` continues from it.
    With a :class:`TileHandoff` (``source``; this class only, not its subclass) the next
    tile comes from it and ``handoff`` counts the tiles it has handed this role.
    """

    # (the order the kernel's loops carried them in; ``handoff`` only with a source)
    _DYNAMIC = ("g", "start", "size", "t", "handoff")

    def __init__(self, group_sizes: cute.Tensor, m, m_tiles, group_tiles, total_tiles, gdim, t, g, start, size,
                 handoff=None, source: "TileHandoff | None" = None):
        self.group_sizes = group_sizes
        self.m = m
        self.m_tiles = m_tiles
        self.group_tiles = group_tiles
        self.total_tiles = total_tiles
        self.gdim = gdim
        self.t, self.g, self.start, self.size = t, g, start, size
        self.handoff, self.source = handoff, source

    def _with(self, t, g, start, size) -> "GroupTileScheduler":
        return GroupTileScheduler(
            self.group_sizes, self.m, self.m_tiles, self.group_tiles, self.total_tiles, self.gdim, t, g, start, size,
            self.handoff, self.source,
        )

    @staticmethod
    def create(group_sizes: cute.Tensor, m, m_tiles, group_tiles, total_tiles, bidx, gdim, size0,
               source: "TileHandoff | None" = None):
        """The cursor at group 0 (``size0``: its clamped size) and this CTA's first tile
        ``bidx``; ``source``: this role's :class:`TileHandoff` (dynamic order) or None."""
        return GroupTileScheduler(
            group_sizes, m, m_tiles, group_tiles, total_tiles, gdim, Int32(bidx), Int32(0), Int32(0), size0,
            Int32(0) if source is not None else None, source,
        )

    def valid(self):
        return self.t < self.total_tiles

    @cute.jit
    def tile_coords(self):
        """``(cursor at the tile's group, row tile, column tile)`` of the current tile."""
        g, start, size = self.g, self.start, self.size
        target = self.t // self.group_tiles
        group_sizes, m = self.group_sizes, self.m
        while g < target:
            start = start + size
            g = g + 1
            size = cutlass.min(cutlass.max(Int32(group_sizes[g]), Int32(0)), m - start)
        local = self.t - g * self.group_tiles
        n_tile = local // self.m_tiles
        return self._with(self.t, g, start, size), local - n_tile * self.m_tiles, n_tile

    def advance(self, tile, claimed=None) -> "GroupTileScheduler":
        """The cursor of ``tile`` (from :meth:`tile_coords`) at this CTA's next tile:
        ``t + gdim``, or the :class:`TileHandoff`'s next one (the producer's from its
        ``claimed`` ticket)."""
        located = tile[0]
        if self.source is None:
            return self._with(located.t + self.gdim, located.g, located.start, located.size)
        t = self.source.next_tile(self.handoff, claimed, located.t + self.gdim)
        return self._handed(self._with(t, located.g, located.start, located.size))


class GroupBlockTileScheduler(GroupTileScheduler):
    """:class:`GroupTileScheduler` that also counts 128-row blocks: ``blk`` is the first
    group-aware block of the cursor's group (the exclusive cumsum of ``cdiv(size, 128)``
    over the clamped sizes of the groups before it), the FP8 weight gradient's K
    coordinate (``grouped_wgrad_fp8_block_sm90``). :meth:`blocks` is the group's count."""

    _DYNAMIC = ("g", "start", "size", "blk", "t")
    BLOCK_ROWS = 128

    def __init__(self, group_sizes: cute.Tensor, m, m_tiles, group_tiles, total_tiles, gdim, t, g, start, size, blk):
        super().__init__(group_sizes, m, m_tiles, group_tiles, total_tiles, gdim, t, g, start, size)
        self.blk = blk

    def _with(self, t, g, start, size, blk=None) -> "GroupBlockTileScheduler":
        return GroupBlockTileScheduler(
            self.group_sizes, self.m, self.m_tiles, self.group_tiles, self.total_tiles, self.gdim, t, g, start, size,
            self.blk if blk is None else blk,
        )

    @staticmethod
    def create(group_sizes: cute.Tensor, m, m_tiles, group_tiles, total_tiles, bidx, gdim, size0):
        """The cursor at group 0, block 0 and this CTA's first tile ``bidx``."""
        return GroupBlockTileScheduler(
            group_sizes, m, m_tiles, group_tiles, total_tiles, gdim, Int32(bidx), Int32(0), Int32(0), size0, Int32(0)
        )

    def blocks(self):
        """The cursor's group's 128-row blocks, ``cdiv(size, 128)``."""
        return (self.size + (self.BLOCK_ROWS - 1)) // self.BLOCK_ROWS

    @cute.jit
    def tile_coords(self):
        """``(cursor at the tile's group, row tile, column tile)`` of the current tile."""
        g, start, size, blk = self.g, self.start, self.size, self.blk
        target = self.t // self.group_tiles
        group_sizes, m = self.group_sizes, self.m
        while g < target:
            start = start + size
            blk = blk + (size + (self.BLOCK_ROWS - 1)) // self.BLOCK_ROWS
            g = g + 1
            size = cutlass.min(cutlass.max(Int32(group_sizes[g]), Int32(0)), m - start)
        local = self.t - g * self.group_tiles
        n_tile = local // self.m_tiles
        return self._with(self.t, g, start, size, blk), local - n_tile * self.m_tiles, n_tile

    def advance(self, tile, claimed=None) -> "GroupBlockTileScheduler":
        """The cursor of ``tile`` (from :meth:`tile_coords`) at this CTA's next tile (static
        order only: ``claimed`` is :meth:`claim`'s None)."""
        located = tile[0]
        return self._with(located.t + self.gdim, located.g, located.start, located.size, located.blk)
