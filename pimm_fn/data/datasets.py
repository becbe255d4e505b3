"""Data sets: real labelled LiDAR tiles, frog-tissue voxels, digits images, synthetic scenes.

Real data sets read files fetched by :mod:`pimm_fn.data.fetch` (never committed); a
missing file raises :class:`~pimm_fn.data.fetch.DatasetMissingError` whose message holds
the command that fetches it. Every data set is map-style, returns dicts of tensors, and
raises a ValueError naming itself when a split comes out empty.

Point samples: ``coord`` [N,3] float32, ``segment`` [N] int64 (-1 = ignore), optionally
``instance`` [N] int64, ``color`` / ``intensity``, and ``name``.
"""
from __future__ import annotations

import base64
import gzip
import os
import re
import zlib
from typing import Optional

import numpy as np
import torch

from ..atomic import atomic_write
from .fetch import require

# --------------------------------------------------------------------------- helpers


def _split_ids(n_blocks: int, split: str, val_every: int) -> list[int]:
    # every val_every-th block (in raster order) goes to val: spatially spread, fixed
    if split == "train":
        return [i for i in range(n_blocks) if i % val_every != val_every - 1]
    if split == "val":
        return [i for i in range(n_blocks) if i % val_every == val_every - 1]
    if split == "all":
        return list(range(n_blocks))
    raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")


def _blocks_xy(xy: np.ndarray, block: float, min_points: int) -> list[np.ndarray]:
    """Group points into a grid of ``block``-sized xy cells; cells with >= min_points."""
    cell = np.floor((xy - xy.min(0)) / block).astype(np.int64)
    key = cell[:, 0] * (int(cell[:, 1].max()) + 1) + cell[:, 1]
    order = np.argsort(key, kind="stable")
    uniq, starts = np.unique(key[order], return_index=True)
    groups = np.split(order, starts[1:])
    return [np.sort(g) for g in groups if g.size >= min_points]


def _empty(name: str, detail: str):
    return ValueError(f"data set {name!r} is empty: {detail}")


# --------------------------------------------------------------------------- LiDAR

# ASPRS classes present in the tile (counts of its 25,408 points): 2 ground 9,808;
# 3/4/5 low/medium/high vegetation 158/724/10,956; 6 building 3,737; 7 noise 25.
LIDAR_CLASSES = ("ground", "vegetation", "building")
LIDAR_ASPRS_TO_CLASS = {2: 0, 3: 1, 4: 1, 5: 1, 6: 2}  # everything else (noise 7) -> ignore

_LAS_CACHE: dict = {}


def _read_las(path) -> dict:
    key = str(path)
    if key not in _LAS_CACHE:
        import laspy

        las = laspy.read(path)
        xyz = np.stack([np.asarray(las.x), np.asarray(las.y), np.asarray(las.z)], 1)
        cls = np.asarray(las.classification).astype(np.int64)
        seg = np.full(cls.shape, -1, dtype=np.int64)
        for asprs, c in LIDAR_ASPRS_TO_CLASS.items():
            seg[cls == asprs] = c
        _LAS_CACHE[key] = dict(
            # subtract the tile origin in float64 before going to float32 (state-plane
            # coordinates are ~1e6 and would lose centimetres in float32)
            coord=(xyz - xyz.min(0)).astype(np.float32),
            intensity=(np.asarray(las.intensity).astype(np.float32) / 65535.0),
            segment=seg,
        )
    return _LAS_CACHE[key]


class LidarBlocks(torch.utils.data.Dataset):
    """Square xy blocks of the ASPRS-classified laspy test tile (ground/vegetation/building).

    The tile is 60 x 40 (state-plane feet), 25,408 points; ``block_size`` 10 gives 24
    blocks (~1,060 points each); every ``val_every``-th block is validation.
    split: "train" | "val" | "all". root: the data cache (default $PIMM_FN_DATA).
    """

    num_classes = len(LIDAR_CLASSES)
    class_names = LIDAR_CLASSES

    def __init__(self, split: str = "train", *, block_size: float = 10.0, min_points: int = 64,
                 val_every: int = 5, root: Optional[os.PathLike] = None):
        self.name = f"lidar[{split}]"
        data = _read_las(require("lidar", root))
        blocks = _blocks_xy(data["coord"][:, :2].astype(np.float64), block_size, min_points)
        self._data = data
        self._blocks = [blocks[i] for i in _split_ids(len(blocks), split, val_every)]
        if not self._blocks:
            raise _empty(self.name, f"no block of size {block_size} has >= {min_points} points")

    def __len__(self):
        return len(self._blocks)

    def __getitem__(self, i):
        idx = self._blocks[i]
        return {
            "coord": torch.from_numpy(self._data["coord"][idx]),
            "intensity": torch.from_numpy(self._data["intensity"][idx]),
            "segment": torch.from_numpy(self._data["segment"][idx]),
            "name": f"{self.name}/block{i}",
        }


# --------------------------------------------------------------------------- frog (VTI)


def read_vti(path) -> tuple[np.ndarray, dict]:
    """Read the first point-data array of a VTK ImageData (.vti) file with numpy alone.

    Handles inline ``binary`` (base64) and ``appended`` (raw or base64) data, optionally
    zlib-compressed, UInt32/UInt64 headers. Returns (array shaped (z, y, x), meta) with
    meta keys extent, spacing, origin.
    """
    raw = open(path, "rb").read()
    head = re.search(rb"<VTKFile[^>]*>", raw).group(0).decode()
    attr = lambda s, k, d=None: (re.search(rf'{k}="([^"]*)"', s) or [None, d])[1]  # noqa: E731
    endian = "<" if attr(head, "byte_order", "LittleEndian") == "LittleEndian" else ">"
    header_t = np.dtype(endian + ("u8" if attr(head, "header_type", "UInt32") == "UInt64" else "u4"))
    compressed = attr(head, "compressor") is not None
    image = re.search(rb"<ImageData[^>]*>", raw).group(0).decode()
    extent = [int(v) for v in attr(image, "WholeExtent").split()]
    meta = dict(extent=extent, spacing=[float(v) for v in attr(image, "Spacing", "1 1 1").split()],
                origin=[float(v) for v in attr(image, "Origin", "0 0 0").split()])
    m = re.search(rb"<DataArray([^>]*)>(.*?)</DataArray>|<DataArray([^>]*)/>", raw, re.S)
    tag = (m.group(1) or m.group(3)).decode()
    types = {"UInt8": "u1", "Int8": "i1", "UInt16": "u2", "Int16": "i2", "UInt32": "u4",
             "Int32": "i4", "Int64": "i8", "UInt64": "u8", "Float32": "f4", "Float64": "f8"}
    dtype = np.dtype(endian + types[attr(tag, "type")])
    fmt = attr(tag, "format")
    hs = header_t.itemsize

    def decode_block_stream(text: bytes, b64: bool):
        # header and payload are base64-encoded separately in VTK's inline binary format
        if compressed:
            if b64:
                n_blocks = int(np.frombuffer(base64.b64decode(text[:((hs + 2) // 3) * 4])[:hs], header_t)[0])
                hlen = (3 + n_blocks) * hs
                h_b64 = -(-hlen // 3) * 4
                header = np.frombuffer(base64.b64decode(text[:h_b64])[:hlen], header_t).astype(np.int64)
                payload = base64.b64decode(text[h_b64:])
            else:
                n_blocks = int(np.frombuffer(text[:hs], header_t)[0])
                hlen = (3 + n_blocks) * hs
                header = np.frombuffer(text[:hlen], header_t).astype(np.int64)
                payload = text[hlen:hlen + int(header[3:].sum())]
            out, off = [], 0
            for size in header[3:]:
                out.append(zlib.decompress(payload[off:off + int(size)]))
                off += int(size)
            return b"".join(out)
        data = base64.b64decode(text) if b64 else text
        nbytes = int(np.frombuffer(data[:hs], header_t)[0])
        return data[hs:hs + nbytes]

    if fmt == "binary":
        body = re.sub(rb"\s", b"", m.group(2))
        buf = decode_block_stream(body, True)
    elif fmt == "appended":
        offset = int(attr(tag, "offset", "0"))
        app = re.search(rb'<AppendedData[^>]*encoding="([^"]*)"[^>]*>\s*_', raw)
        start = app.end() + offset
        if app.group(1) == b"base64":
            end = raw.index(b"</AppendedData>", start)
            body = re.sub(rb"\s", b"", raw[start:end])
            buf = decode_block_stream(body, True)
        else:
            buf = decode_block_stream(raw[start:], False)
    elif fmt == "ascii":
        buf = np.array(m.group(2).split(), dtype=dtype).tobytes()
    else:
        raise ValueError(f"{path}: unsupported DataArray format {fmt!r}")
    arr = np.frombuffer(buf, dtype)
    nx, ny, nz = (extent[1] - extent[0] + 1, extent[3] - extent[2] + 1, extent[5] - extent[4] + 1)
    ncomp = int(attr(tag, "NumberOfComponents", "1"))
    if arr.size != nx * ny * nz * ncomp:
        raise ValueError(f"{path}: {arr.size} values for a {nx}x{ny}x{nz} image")
    return arr.reshape(nz, ny, nx) if ncomp == 1 else arr.reshape(nz, ny, nx, ncomp), meta


# Label values 1..15 are the frequent tissues (3,891-438,052 voxels each); the ten rare
# ones (16, 17, 20, 21, 23-27, 29: 4-252 voxels) share class 15; 0 is background.
FROG_NUM_CLASSES = 16


def frog_voxels(root: Optional[os.PathLike] = None) -> dict:
    """All labelled voxels of the frog volume: ``ijk`` [M,3] int16, ``label`` [M] uint8
    (raw tissue ids), ``spacing``. Cached as an .npz next to the .vti after the first parse."""
    vti = require("frog", root)
    npz = vti.with_name("frog_voxels.npz")
    if not npz.is_file():
        vol, meta = read_vti(vti)
        k, j, i = np.nonzero(vol)
        # a per-process temp name: two ranks parsing at once no longer write one ".part" file
        atomic_write(npz, lambda f: np.savez(f, ijk=np.stack([i, j, k], 1).astype(np.int16),
                                             label=vol[k, j, i], spacing=np.asarray(meta["spacing"])),
                     durable=False)
    with np.load(npz) as z:
        return {k: z[k] for k in z.files}


class FrogTissueBlocks(torch.utils.data.Dataset):
    """The pyvista frog-tissue volume as labelled points: xy blocks of ``block`` voxels,
    each subsampled (fixed per block) to at most ``max_points``; 16 classes.

    1,154,287 labelled voxels of a 500x470x136 grid (spacing 1, 1, 1.5); ``block`` 64
    gives 36 blocks with >= ``min_points`` voxels (29 train, 7 val). Every ``val_every``-th block is val.
    """

    num_classes = FROG_NUM_CLASSES

    def __init__(self, split: str = "train", *, block: int = 64, max_points: int = 8192,
                 min_points: int = 1024, val_every: int = 5, root: Optional[os.PathLike] = None):
        self.name = f"frog[{split}]"
        vox = frog_voxels(root)
        self._coord = (vox["ijk"].astype(np.float32) * vox["spacing"].astype(np.float32))
        label = vox["label"].astype(np.int64)
        self._segment = np.where(label <= 15, label - 1, 15)
        blocks = _blocks_xy(vox["ijk"][:, :2].astype(np.float64), float(block), min_points)
        picked = []
        for b, idx in enumerate(blocks):
            if idx.size > max_points:
                rng = np.random.default_rng(b)  # fixed per block: a data set, not an augmentation
                idx = np.sort(rng.choice(idx, max_points, replace=False))
            picked.append(idx)
        self._blocks = [picked[i] for i in _split_ids(len(picked), split, val_every)]
        if not self._blocks:
            raise _empty(self.name, f"no block of {block} voxels has >= {min_points} labelled voxels")

    def __len__(self):
        return len(self._blocks)

    def __getitem__(self, i):
        idx = self._blocks[i]
        return {"coord": torch.from_numpy(self._coord[idx]),
                "segment": torch.from_numpy(self._segment[idx]),
                "name": f"{self.name}/block{i}"}


# --------------------------------------------------------------------------- digits


class DigitsImages(torch.utils.data.Dataset):
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes) as
    ``image`` [1,8,8] float32 in [0,1] and ``label`` int64; every 5th image is val."""

    num_classes = 10

    def __init__(self, split: str = "train", *, val_every: int = 5, root: Optional[os.PathLike] = None):
        self.name = f"digits[{split}]"
        path = require("digits", root)
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float32)
        ids = _split_ids(len(table), split, val_every)
        if not ids:
            raise _empty(self.name, f"{path} holds no rows")
        self._images = torch.from_numpy(table[ids, :64].reshape(-1, 1, 8, 8) / 16.0)
        self._labels = torch.from_numpy(table[ids, 64].astype(np.int64))

    def __len__(self):
        return len(self._labels)

    def __getitem__(self, i):
        return {"image": self._images[i], "label": self._labels[i]}


# --------------------------------------------------------------------------- synthetic

SYNTHETIC_CLASSES = ("ground", "box", "sphere", "cylinder")


def synthetic_scene(seed: int, *, points=(512, 1024), max_objects: int = 4) -> dict:
    """One scene of primitive shapes on a ground plane, a pure function of ``seed``.

    Returns coord [N,3] float32, color [N,3] float32 in [0,1], segment [N] (0 ground,
    1 box, 2 sphere, 3 cylinder), instance [N] (-1 ground, objects 0..K-1).
    """
    g = torch.Generator().manual_seed(int(seed))
    n = int(torch.randint(points[0], points[1] + 1, (), generator=g))
    k = int(torch.randint(1, max_objects + 1, (), generator=g))
    n_ground = n // 3
    sizes = torch.full((k,), (n - n_ground) // k)
    sizes[: (n - n_ground) % k] += 1
    coords = [torch.cat([torch.rand(n_ground, 2, generator=g) * 10, 0.02 * torch.randn(n_ground, 1, generator=g)], 1)]
    segs, insts = [torch.zeros(n_ground, dtype=torch.int64)], [torch.full((n_ground,), -1, dtype=torch.int64)]
    for obj, m in enumerate(sizes.tolist()):
        cls = int(torch.randint(1, 4, (), generator=g))
        centre = torch.cat([torch.rand(2, generator=g) * 8 + 1, torch.zeros(1)])
        r = 0.3 + 0.7 * float(torch.rand((), generator=g))
        if cls == 1:  # box: uniform in a cube on the ground
            p = (torch.rand(m, 3, generator=g) - torch.tensor([0.5, 0.5, 0.0])) * 2 * r
        elif cls == 2:  # sphere surface, resting on the ground
            d = torch.randn(m, 3, generator=g)
            p = d / d.norm(dim=1, keepdim=True) * r + torch.tensor([0.0, 0.0, r])
        else:  # cylinder side, height 3r
            a = torch.rand(m, generator=g) * 2 * torch.pi
            p = torch.stack([r * torch.cos(a), r * torch.sin(a), torch.rand(m, generator=g) * 3 * r], 1)
        coords.append(p + centre)
        segs.append(torch.full((m,), cls, dtype=torch.int64))
        insts.append(torch.full((m,), obj, dtype=torch.int64))
    segment = torch.cat(segs)
    palette = torch.tensor([[0.4, 0.3, 0.2], [0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]])
    color = (palette[segment] + 0.05 * torch.randn(n, 3, generator=g)).clamp(0, 1)
    return {"coord": torch.cat(coords).float(), "color": color, "segment": segment,
            "instance": torch.cat(insts)}


class SyntheticScenes(torch.utils.data.Dataset):
    """``num_scenes`` synthetic scenes (see :func:`synthetic_scene`); scene i is fixed by
    (seed, i). 4 semantic classes, per-object instance ids."""

    num_classes = len(SYNTHETIC_CLASSES)

    def __init__(self, num_scenes: int = 32, *, seed: int = 0, points=(512, 1024), max_objects: int = 4,
                 name: str = "synthetic"):
        self.num_scenes, self.seed, self.points, self.max_objects = int(num_scenes), int(seed), points, max_objects
        self.name = name

    def __len__(self):
        return self.num_scenes

    def __getitem__(self, i):
        if not 0 <= i < self.num_scenes:
            raise IndexError(f"{self.name}: index {i} out of range {self.num_scenes}")
        s = synthetic_scene(self.seed * 1_000_003 + i, points=self.points, max_objects=self.max_objects)
        s["name"] = f"{self.name}/{i}"
        return s


class SyntheticStream(torch.utils.data.IterableDataset):
    """A streaming (iterable) data set of synthetic scenes that shards itself over ranks
    and workers; its order is a pure function of (seed, epoch), set by ``set_epoch``.

    num_samples(): scenes per epoch over all ranks (drives the epoch length).
    """

    def __init__(self, num_scenes: int = 64, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 points=(256, 512), name: str = "synthetic_stream"):
        self.num_scenes, self.seed, self.rank, self.world_size = int(num_scenes), int(seed), int(rank), int(world_size)
        self.points, self.name, self.epoch = points, name, 0

    def num_samples(self) -> int:
        return self.num_scenes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_scenes, generator=g).tolist()
        mine = order[self.rank::self.world_size][wid::nw]
        for i in mine:
            s = synthetic_scene(self.seed * 1_000_003 + i, points=self.points)
            s["name"] = f"{self.name}/{i}"
            yield s
