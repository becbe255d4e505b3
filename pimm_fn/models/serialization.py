"""Point topology for serialized-attention models: space-filling codes, patches, neighbours, pools.

Point Transformer V3 (Wu et al., CVPR 2024) replaces neighbour search by *serialization*:
the points of a cloud are sorted along a space-filling curve (z-order or Hilbert, and the
same curves over axes with x and y swapped, the "transposed" variants), cut into patches
of K consecutive points, and attention runs inside each patch. Everything such a model
needs besides its weights is integer structure computed from the voxel coordinates:

    orders      one permutation of the points per curve
    patches     for each order, the point in each of K slots of every patch (clouds padded
                to a multiple of K by repeating their own points), each point's slot, and
                the slots that repeat a point
    neighbours  the 27 grid neighbours of each point (submanifold 3x3x3 convolution)
    pooling     the cluster (voxel of twice the size) each point merges into

:func:`build_topology` computes all of it for every level of a U-Net with pure torch code.
It runs either in the loader's workers (the collate of :class:`~pimm_fn.models.PTv3`:
the compiled step then holds only gathers, matmuls and reductions, every size an input
size) or inside the model's forward (see docs/models.md for the measured comparison).
"""
from __future__ import annotations

from typing import Optional

import attrs
import torch

__all__ = ["CENTRE", "OFF_CENTRE", "ORDERS", "TopologySpec", "build_topology", "hilbert_code", "neighbour_map",
           "neighbour_pairs", "serial_code", "z_order_code"]

ORDERS = ("z", "z-trans", "hilbert", "hilbert-trans")
_BITS = 16  # bits per axis of a code: grids up to 65,536 voxels a side
_CUBE = [(dx, dy, dz) for dx in (-1, 0, 1) for dy in (-1, 0, 1) for dz in (-1, 0, 1)]
CENTRE = _CUBE.index((0, 0, 0))  # 13: every voxel is its own centre neighbour
OFF_CENTRE = tuple(k for k in range(27) if k != CENTRE)  # the offsets neighbour_pairs lists, in order


def z_order_code(grid: torch.Tensor, bits: int = _BITS) -> torch.Tensor:
    """Morton code of non-negative integer ``grid`` [N, 3]: the bits of x, y, z interleaved."""
    x, y, z = grid.long().unbind(1)
    code = torch.zeros_like(x)
    for b in range(bits):
        code |= ((x >> b) & 1) << (3 * b + 2) | ((y >> b) & 1) << (3 * b + 1) | ((z >> b) & 1) << (3 * b)
    return code


def hilbert_code(grid: torch.Tensor, bits: int = _BITS) -> torch.Tensor:
    """Index along the 3-D Hilbert curve of order ``bits`` of non-negative ``grid`` [N, 3].

    Skilling's transform ("Programming the Hilbert curve", AIP Conf. Proc. 707, 2004):
    undo the curve's per-level rotations and reflections, Gray-encode, then read the
    transposed bits as one index. Consecutive indices are face-adjacent voxels.
    """
    x = [c for c in grid.long().unbind(1)]
    q = 1 << (bits - 1)
    while q > 1:
        p = q - 1
        for i in range(3):
            hit = (x[i] & q) != 0
            if i == 0:
                x[0] = torch.where(hit, x[0] ^ p, x[0])
            else:
                t = (x[0] ^ x[i]) & p
                x[0], x[i] = torch.where(hit, x[0] ^ p, x[0] ^ t), torch.where(hit, x[i], x[i] ^ t)
        q >>= 1
    x[1] = x[1] ^ x[0]
    x[2] = x[2] ^ x[1]
    t = torch.zeros_like(x[0])
    q = 1 << (bits - 1)
    while q > 1:
        t = torch.where((x[2] & q) != 0, t ^ (q - 1), t)
        q >>= 1
    x = [c ^ t for c in x]
    code = torch.zeros_like(x[0])
    for b in range(bits - 1, -1, -1):
        for i in range(3):
            code = (code << 1) | ((x[i] >> b) & 1)
    return code


def serial_code(grid: torch.Tensor, batch: torch.Tensor, order: str, bits: int = _BITS) -> torch.Tensor:
    """Sort key of each point along curve ``order`` (one of :data:`ORDERS`), clouds apart.

    The cloud id takes the bits above the curve's 3 * ``bits``, so sorting by the key keeps
    every cloud contiguous and in batch order.
    """
    if order not in ORDERS:
        raise ValueError(f"unknown serialization order {order!r}; choose from {ORDERS}")
    if order.endswith("-trans"):
        grid = grid[:, [1, 0, 2]]
    code = z_order_code(grid, bits) if order.startswith("z") else hilbert_code(grid, bits)
    return batch.long() << (3 * bits) | code


def _cloud_ranges(batch: torch.Tensor, num_clouds: int):
    counts = torch.bincount(batch, minlength=num_clouds)
    starts = torch.cumsum(counts, 0) - counts
    return counts, starts


def patch_slots(batch: torch.Tensor, num_clouds: int, patch: int):
    """Padded patch layout of points sorted cloud by cloud.

    Each cloud of n points takes ceil(n / K) * K slots. A slot past the cloud's end repeats
    the point K slots before it (the cloud's previous patch), or for a cloud smaller than
    K its points in turn, so a patch never mixes clouds. Returns (source [P] sorted
    position of each slot's point, slot [N] the slot of each sorted position, pads: the
    repeating slots, then two entries P, a padding past the end: never shorter than 2,
    the least size a compiled step traces as unknown). The pads depend on the cloud
    sizes only, so they are the same for every order.
    """
    counts, starts = _cloud_ranges(batch, num_clouds)
    padded = (counts + patch - 1) // patch * patch
    pad_starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    slot_cloud = torch.repeat_interleave(torch.arange(num_clouds, device=batch.device), padded,
                                         output_size=total)
    local = torch.arange(total, device=batch.device) - pad_starts[slot_cloud]
    n = counts[slot_cloud]
    repeats = local >= n
    local = torch.where(repeats, torch.where(n >= patch, local - patch, local % n.clamp_min(1)), local)
    source = starts[slot_cloud] + local
    position = torch.arange(batch.numel(), device=batch.device)
    slot = pad_starts[batch] + position - starts[batch]
    pads = torch.cat([torch.nonzero(repeats).flatten(), torch.full((2,), total, device=batch.device)])
    return source, slot, pads


def _grid_key(grid: torch.Tensor, batch: torch.Tensor, extent: torch.Tensor) -> torch.Tensor:
    g = grid + 1  # a neighbour at -1 is still a valid digit
    return ((batch * extent[0] + g[:, 0]) * extent[1] + g[:, 1]) * extent[2] + g[:, 2]


def neighbour_map(grid: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """The 3x3x3 grid neighbours of every voxel: [N, 27] row indices, N where there is none.

    A voxel is its own middle neighbour (column 13). Keys are exact mixed-radix numbers
    over (cloud, x, y, z), found by sort and binary search; voxels must be unique per cloud.
    """
    grid = grid.long()
    extent = grid.max(dim=0).values + 3
    keys = _grid_key(grid, batch, extent)
    sorted_keys, perm = torch.sort(keys)
    n = grid.shape[0]
    cube = torch.tensor(_CUBE, dtype=grid.dtype, device=grid.device)
    probe = _grid_key((grid.unsqueeze(1) + cube).reshape(-1, 3), batch.repeat_interleave(27), extent)
    at = torch.searchsorted(sorted_keys, probe).clamp_max(n - 1)
    found = sorted_keys[at] == probe
    return torch.where(found, perm[at], torch.full_like(at, n)).reshape(n, 27)


def neighbour_pairs(neighbours: torch.Tensor) -> dict:
    """The present neighbours of a :func:`neighbour_map`, offset by offset (the centre left out).

    Returns ``{"rows": [...], "cols": [...]}``, 26 index tensors each: at offset k, voxel
    ``rows[k][p]`` has voxel ``cols[k][p]`` as its neighbour; within an offset no row and no
    column repeats. A sparse convolution then multiplies only these pairs (on point data
    most of the 26 are empty). Each list ends with two pairs (N, N), a padding row on both
    sides: no list is shorter than 2, the least size a compiled step traces as unknown.
    """
    n = neighbours.shape[0]
    pad_rows = pad_cols = torch.full((2,), n, dtype=neighbours.dtype, device=neighbours.device)
    rows, cols = [], []
    for k in OFF_CENTRE:
        column = neighbours[:, k]
        present = torch.nonzero(column < n).flatten()
        rows.append(torch.cat([present, pad_rows]))
        cols.append(torch.cat([column[present], pad_cols]))
    return {"rows": rows, "cols": cols}


def grid_pool(grid: torch.Tensor, batch: torch.Tensor, stride: int = 2):
    """Merge voxels into the voxels of ``stride`` times their size, per cloud.

    Returns (cluster [N] the coarse voxel of each point, coarse grid [M, 3], coarse batch
    [M]); coarse voxels are ordered by (cloud, key), so clouds stay contiguous.
    """
    coarse = torch.div(grid.long(), stride, rounding_mode="floor")
    extent = coarse.max(dim=0).values + 3
    keys, cluster = torch.unique(_grid_key(coarse, batch, extent), return_inverse=True)
    first = torch.full((keys.numel(),), grid.shape[0], dtype=torch.long, device=grid.device)
    first = first.scatter_reduce(0, cluster, torch.arange(grid.shape[0], device=grid.device), "amin")
    return cluster, coarse[first], batch[first]


@attrs.frozen
class TopologySpec:
    """What the topology of a serialized-attention U-Net depends on (picklable for workers).

    patch_sizes: K of each level (level 0 = input voxels, each later one pooled by
        ``stride``). orders: the curves, each block of a level uses one in turn.
    shuffle_orders: permute the orders per level and batch (PTv3's order shuffle), drawn
        from the batch's seed so a resumed run draws the same.
    """

    patch_sizes: tuple = attrs.field(converter=tuple)
    orders: tuple = attrs.field(default=ORDERS, converter=tuple)
    shuffle_orders: bool = True
    stride: int = 2

    def __attrs_post_init__(self):
        bad = [o for o in self.orders if o not in ORDERS]
        if bad or not self.orders:
            raise ValueError(f"orders must be a non-empty subset of {ORDERS}, got {self.orders}")
        if any(int(k) < 1 for k in self.patch_sizes) or not self.patch_sizes:
            raise ValueError(f"patch_sizes must be positive, one per level; got {self.patch_sizes}")

    @property
    def levels(self) -> int:
        return len(self.patch_sizes)


def build_topology(grid_coord: torch.Tensor, offset: torch.Tensor, spec: TopologySpec,
                   generator: Optional[torch.Generator] = None) -> dict:
    """Every level's topology for a point batch (Pointcept's ``grid_coord`` and ``offset``).

    Returns ``{"levels": [level 0, level 1, ...]}``, each level a dict:
      ``neighbours`` [N_l, 27] (:func:`neighbour_map`),
      ``pairs``      the present neighbours offset by offset (:func:`neighbour_pairs`),
      ``patches``    a list, per order, of [P_l / K_l, K_l] point indices (the padded patches),
      ``slots``      a list, per order, of [N_l] each point's slot in the flattened patches,
      ``pads``       the slots that repeat a point (the same for every order; :func:`patch_slots`),
      ``pool``       [N_l] the point of level l + 1 each point merges into (not on the last level).
    Level sizes N_l and P_l vary with the batch; the list lengths and K_l do not.
    """
    num_clouds = offset.numel()
    grid = grid_coord.long()
    batch = torch.repeat_interleave(torch.arange(num_clouds, device=offset.device),
                                    torch.diff(offset, prepend=offset.new_zeros(1)), output_size=grid.shape[0])
    grid = grid - grid.min(dim=0).values
    levels = []
    for level, patch in enumerate(spec.patch_sizes):
        orders = list(spec.orders)
        if spec.shuffle_orders and len(orders) > 1:
            orders = [orders[i] for i in torch.randperm(len(orders), generator=generator).tolist()]
        # Every order keeps the clouds contiguous and in batch order (batch is sorted at every
        # level), so the padded layout of the sorted points is one for all orders.
        source, slot, pads = patch_slots(batch, num_clouds, int(patch))
        patches, slots = [], []
        for order in orders:
            perm = torch.argsort(serial_code(grid, batch, order))
            patches.append(perm[source].reshape(-1, int(patch)))
            slots.append(torch.empty_like(slot).scatter_(0, perm, slot))
        neighbours = neighbour_map(grid, batch)
        entry = {"neighbours": neighbours, "pairs": neighbour_pairs(neighbours), "patches": patches, "slots": slots,
                 "pads": pads}
        if level + 1 < spec.levels:
            entry["pool"], grid, batch = grid_pool(grid, batch, spec.stride)
        levels.append(entry)
    return {"levels": levels}
