"""Geometry of the peer window (DESIGN §2b), as pure functions: where every output element lands.

Ulysses attention over P ranks, sequence S, heads H (rank r owns heads h0 .. h0+Hr, ``head_split``), batch B.
Every rank holds ``L = ceil(S / P)`` rows per owner (``torch.chunk``: the last owners may be short or empty).

Owner as batch: on rank r, attention of the whole sequence for its heads equals a batch of B*P query
blocks, block ``i = b*P + o`` = the L tokens owner o holds in batch b, each attending all S keys of batch b.
So the kernel sees

    Q   : (B*P, L, Hr, D)   block i = rows [o*L, (o+1)*L) of batch b of the gathered q
    out : (B*P, L, Hr, D)   strides (slot_elems, H*D, D, 1), offset h0*D  into the window

where window slot ``i`` is owner o's output buffer for batch b, laid out (L, H, D). The kernel's own
epilogue then stores each tile at its final place in its owner's buffer: the post-attention All-to-All.

Padding: owner o has ``rows(o) = max(0, min(L, S - o*L))`` valid rows; rows ``[rows(o), L)`` of its slot are
padding. A kernel that writes them is writing into a peer's memory for nothing; kernels take the valid
row counts (``seqused_q``) and never touch them (the tests poison and check them).

Everything here is integers: the CPU tests check it against a reference by fake pointer arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from xstage_dit.ops.attention.partition import head_split, shard_bounds


def shard_rows(seq_len: int, world_size: int) -> list[int]:
    """Valid rows of every owner (``partition.shard_bounds``: ``L = ceil(S/P)``, the last owners short)."""
    return [n for _, n in shard_bounds(seq_len, world_size)]


# (first head, head count) per rank: the partition's own rule, one owner of the fact.
head_ranges = head_split


@dataclass(frozen=True)
class ViewSpec:
    """A strided view into the window, in elements from slot 0's buffer start."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    def address(self, index: tuple[int, ...]) -> int:
        """Element offset of ``index`` (the pointer arithmetic every kernel performs)."""
        if len(index) != len(self.shape) or any(not 0 <= i < n for i, n in zip(index, self.shape)):
            raise IndexError(f"expected an index inside {self.shape}, got {index}")
        return self.offset + sum(i * s for i, s in zip(index, self.strides))


@dataclass(frozen=True)
class WindowGeometry:
    """One Ulysses attention call's window layout.

    world_size P, batch B, seq_len S, heads H, head_dim D; ``slot_elems``: the window's slot stride in
    elements (``PeerWindow.slot_bytes // elem``), at least ``L * H * D``.
    """

    world_size: int
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    slot_elems: int

    def __post_init__(self):
        for name in ("world_size", "batch", "seq_len", "heads", "head_dim", "slot_elems"):
            if getattr(self, name) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")
        head_ranges(self.heads, self.world_size)
        if self.slot_elems < self.buffer_elems:
            raise ValueError(f"expected slot_elems >= L*H*D = {self.buffer_elems}, got {self.slot_elems}")

    @property
    def rows_per_owner(self) -> int:
        """L = ceil(S / P)."""
        return -(-self.seq_len // self.world_size)

    @property
    def buffer_elems(self) -> int:
        """Elements of one owner's output buffer for one batch element: (L, H, D)."""
        return self.rows_per_owner * self.heads * self.head_dim

    @property
    def num_slots(self) -> int:
        return self.batch * self.world_size

    def slot(self, batch: int, owner: int) -> int:
        """Window slot of (batch b, owner o): ``b * P + o`` (batch-major, matching Q's owner-batch view)."""
        if not (0 <= batch < self.batch and 0 <= owner < self.world_size):
            raise IndexError(f"expected batch < {self.batch} and owner < {self.world_size}, got ({batch}, {owner})")
        return batch * self.world_size + owner

    def owner_rows(self) -> list[int]:
        return shard_rows(self.seq_len, self.world_size)

    def heads_of(self, rank: int) -> tuple[int, int]:
        return head_ranges(self.heads, self.world_size)[rank]

    def out_view(self, rank: int) -> ViewSpec:
        """Rank r's output view: (B*P, L, Hr, D), strides (slot_elems, H*D, D, 1), offset h0*D."""
        h0, hr = self.heads_of(rank)
        d = self.head_dim
        return ViewSpec((self.num_slots, self.rows_per_owner, hr, d), (self.slot_elems, self.heads * d, d, 1), h0 * d)

    def owner_buffer(self, batch: int, owner: int) -> ViewSpec:
        """Owner o's (L, H, D) output buffer of batch b, as the owner reads it."""
        d = self.head_dim
        return ViewSpec((self.rows_per_owner, self.heads, d), (self.heads * d, d, 1),
                        self.slot(batch, owner) * self.slot_elems)

    def seqused_q(self) -> list[int]:
        """Valid rows of every owner-batch block, block order ``b*P + o`` (a kernel's ``seqused_q``)."""
        return self.owner_rows() * self.batch

    def padding_rows(self) -> list[tuple[int, int, int, int]]:
        """(batch, owner, first padding row, end) for every slot with padding rows (never written)."""
        rows, length = self.owner_rows(), self.rows_per_owner
        return [(b, o, rows[o], length) for b in range(self.batch) for o in range(self.world_size)
                if rows[o] < length]

    def table_strides(self) -> tuple[int, int, int]:
        """(batch, row, head) element strides of the owner buffers as the pointer-table kernel sees them
        through the window: owner o's table entry is slot (0, o); batch b is ``b * P`` slots further."""
        d = self.head_dim
        return self.world_size * self.slot_elems, self.heads * d, d


def window_destination(geom: WindowGeometry, rank: int, batch: int, row: int, head_local: int, dim: int
                       ) -> tuple[int, int, int]:
    """Where rank r's output element (batch, global row, local head, dim) must land, by the definition of the
    post-attention All-to-All: (owner, owner's element offset in its (L, H, D) buffer, window element offset).

    The reference the view arithmetic is tested against: owner = row // L, local row = row - owner*L, head
    h0 + head_local of that owner's buffer.
    """
    if not 0 <= row < geom.seq_len:
        raise IndexError(f"expected row < {geom.seq_len}, got {row}")
    h0, hr = geom.heads_of(rank)
    if not 0 <= head_local < hr:
        raise IndexError(f"expected head_local < {hr}, got {head_local}")
    owner, local_row = divmod(row, geom.rows_per_owner)
    in_buffer = (local_row * geom.heads + h0 + head_local) * geom.head_dim + dim
    return owner, in_buffer, geom.slot(batch, owner) * geom.slot_elems + in_buffer


def owner_batch_strides(batch_stride: int, row_stride: int, head_stride: int, world_size: int, rows_per_owner: int,
                        batch: int) -> tuple[int, int, int, int] | None:
    """Strides of the (B*P, L, Hr, D) owner-batch view of a (B, >= P*L, Hr, D) tensor, or None where no
    single batch stride exists (B > 1 and the batch stride is not P*L rows: launch per batch instead)."""
    block = rows_per_owner * row_stride
    if batch > 1 and batch_stride != world_size * block:
        return None
    return block, row_stride, head_stride, 1


@dataclass(frozen=True)
class PitchedCopy:
    """One pitched copy of the pre-attention All-to-All (bytes): ``height`` rows of ``width`` from source
    tensor ``tensor`` (0 q, 1 k, 2 v) of rank ``src_rank`` at ``src_offset`` (rows ``src_pitch`` apart) into
    owner ``owner``'s input buffer at ``dst_offset`` (rows ``dst_pitch`` apart)."""

    src_rank: int
    owner: int
    tensor: int
    batch: int
    src_offset: int
    src_pitch: int
    dst_offset: int
    dst_pitch: int
    width: int
    height: int


def pre_a2a_copies(*, batch: int, seq_len: int, heads: int, head_dim: int, world_size: int, elem_bytes: int
                   ) -> list[PitchedCopy]:
    """The pre-attention All-to-All as pitched copies (the copy engine's form of the push kernel's stores).

    Source: rank r's contiguous (batch, rows_r, heads, head_dim) q, k, v. Destination: owner o's contiguous
    (3, batch, P*L, Hr_max, head_dim) input buffer, rows [r*L, r*L + rows_r) of owner o's heads (padding rows
    and heads past Hr untouched). One copy per (rank, owner, tensor, batch element) with rows; none for empty
    shards.
    """
    rows = shard_rows(seq_len, world_size)
    length = -(-seq_len // world_size)
    ranges = head_ranges(heads, world_size)
    hmax = ranges[0][1]
    copies = []
    for r, n in enumerate(rows):
        if n == 0:
            continue
        for o, (h0, hr) in enumerate(ranges):
            for t in range(3):
                for b in range(batch):
                    copies.append(PitchedCopy(
                        r, o, t, b, src_offset=(b * n * heads + h0) * head_dim * elem_bytes,
                        src_pitch=heads * head_dim * elem_bytes,
                        dst_offset=((t * batch + b) * world_size * length + r * length) * hmax * head_dim * elem_bytes,
                        dst_pitch=hmax * head_dim * elem_bytes, width=hr * head_dim * elem_bytes, height=n))
    return copies
