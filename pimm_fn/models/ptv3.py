"""A Point Transformer V3-class backbone whose whole training step compiles.

Written from the paper (Wu et al., "Point Transformer V3: Simpler, Faster, Stronger",
CVPR 2024) and the public description of its design:

- the input voxels are serialized along space-filling curves (z-order, Hilbert and their
  transposed variants; the orders shuffled per level) and cut into patches of K points;
  attention is plain multi-head ``scaled_dot_product_attention`` inside each patch, each
  block of a level using the next order, so information crosses patch borders;
- every block starts with a conditional positional encoding: a submanifold 3x3x3 sparse
  convolution over the grid neighbours (here a matmul per offset over the neighbours that
  exist, listed by the collate), a linear layer and
  LayerNorm, added to the features; then pre-norm attention and a GELU MLP, each with
  drop path;
- a U-Net: grid pooling by stride 2 (linear, max over the points of each coarse voxel,
  BatchNorm, GELU) between encoder levels, and unpooling (the coarse features gathered back
  to their points plus a projection of the skip) in the decoder.

Point data travels as tensors: the integer topology of every level (orders, patches,
neighbours, pooling clusters, :mod:`pimm_fn.models.serialization`) arrives in the batch
under ``"topology"``, computed by the loader's workers through :meth:`PTv3.collate`, so the
step holds only gathers, matmuls and reductions over sizes it reads from its inputs. A
batch without it gets its topology computed inside the forward (eager use, measurement).

Calling convention as Pointcept's segmentors: ``model(batch) -> dict`` with ``seg_logits``
and, when the batch has ``segment``, ``loss`` and ``acc``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.collate import PointCollate
from ..ops import neighbour_conv
from ._common import classification_outputs, make_norm
from .serialization import CENTRE, OFF_CENTRE, ORDERS, TopologySpec, build_topology

__all__ = ["PTv3", "PTv3Collate", "layer_decay_groups"]


def _per_level(value, levels: int, name: str) -> tuple:
    out = tuple(value) if isinstance(value, Sequence) else (value,) * levels
    if len(out) != levels:
        raise ValueError(f"{name} needs one value per level ({levels}), got {out}")
    return out


class SubMConv(nn.Module):
    """Submanifold 3x3x3 convolution: each voxel mixes its existing grid neighbours only.

    ``neighbours`` [N, 27] holds row indices, N for an empty neighbour (a zero row), as
    :func:`~pimm_fn.models.serialization.neighbour_map` builds it. With ``pairs`` (the
    level's :func:`~pimm_fn.models.serialization.neighbour_pairs`) only present neighbours
    are multiplied: one matmul per offset over its pairs, added into their rows. On point
    data most of the 26 offsets are empty, so this is most of the dense form's work saved
    (benchmarks/README.md, "The PTv3-class backbone"). Without, the dense form: a gather to
    [N, 27, C] and one matmul. Same weights, same result to rounding.

    The sparse form runs as one op (:func:`~pimm_fn.ops.neighbour_conv`), which a compiled
    step calls instead of tracing its 26 offsets: a much shorter cold compile. With
    ``trace=True`` a compiled step traces it instead and inductor fuses each offset's
    gather and add: faster compiled steps, a longer compile (benchmarks/README.md, "Sparse
    convolutions as ops"). Eager calls always use the op. Both give the same bits.
    """

    def __init__(self, cin: int, cout: int, bias: bool = True, trace: bool = False):
        super().__init__()
        self.trace = trace
        self.weight = nn.Parameter(torch.empty(27 * cin, cout))
        self.bias = nn.Parameter(torch.zeros(cout)) if bias else None
        nn.init.kaiming_uniform_(self.weight.T, a=5 ** 0.5)  # as nn.Linear, fan-in 27 * cin

    def forward(self, x: torch.Tensor, neighbours: torch.Tensor, pairs: Optional[dict] = None) -> torch.Tensor:
        if pairs is None:
            out = _NeighbourGather.apply(x, neighbours).flatten(1) @ self.weight
        elif self.trace and torch.compiler.is_compiling():
            out = _SparseNeighbourConv.apply(x, self.weight, *pairs["rows"], *pairs["cols"])
        else:
            weight = self.weight.view(27, x.shape[1], -1)
            out = neighbour_conv(x, weight, OFF_CENTRE, pairs["rows"], pairs["cols"], centre=CENTRE)
        return out if self.bias is None else out + self.bias


def _minus_product(base: torch.Tensor, a: torch.Tensor, neg_b: torch.Tensor) -> torch.Tensor:
    """``base + a @ b`` given ``-b``, bit for bit (negation is exact, rounding symmetric).

    Inductor's CPU lowering turns ``base + a @ b`` into ``addmm``, which first copies
    ``base`` (here a gathered block) into its output: a copy and a kernel more per offset
    than a matmul followed by one fused gather-add-store. A subtraction is not matched.
    """
    return base - a @ neg_b


class _SparseNeighbourConv(torch.autograd.Function):
    """The submanifold convolution over the present neighbour pairs, offset by offset, traced.

    ``SubMConv(trace=True)``'s form inside a compiled step: inductor fuses each offset's
    gather and add into its store (faster steps, a longer cold compile than the op's).

    ``apply(x, weight, *rows, *cols)`` with the 26 row and 26 column lists of
    :func:`~pimm_fn.models.serialization.neighbour_pairs`. Within one offset no row or
    column repeats but the padding row N, so both the forward's additions into rows and the
    backward's into columns are plain stores into one buffer (no accumulating scatter: in
    compiled CPU code that is atomic adds, summed in thread order), and no gradient is ever
    as large as the input per offset: one autograd node, sparse both ways.
    """

    @staticmethod
    def forward(x, weight, *index):
        rows, cols = index[:26], index[26:]
        w = weight.view(27, x.shape[1], -1)
        # Row N on both sides: the empty neighbour (zeros) and a sink for the padding pairs.
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        out = torch.cat([x @ w[CENTRE], x.new_zeros(1, w.shape[2])])
        neg_w = -w  # see _minus_product
        for k, r, c in zip(OFF_CENTRE, rows, cols):
            out = out.index_put((r,), _minus_product(out[r], padded[c], neg_w[k]))
        return out[:-1]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, *index = ctx.saved_tensors
        rows, cols = index[:26], index[26:]
        # In the gradient's dtype: under autocast the forward's products ran in a lower
        # precision, and the backward runs outside autocast.
        x_dtype, x = x.dtype, x.to(grad.dtype)
        w = weight.view(27, x.shape[1], -1).to(grad.dtype)
        grad_padded = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([grad @ w[CENTRE].T, grad.new_zeros(1, x.shape[1])])
            neg_wt = -w.transpose(1, 2)
            for k, r, c in zip(OFF_CENTRE, rows, cols):
                grad_x = grad_x.index_put((c,), _minus_product(grad_x[c], grad_padded[r], neg_wt[k]))
            grad_x = grad_x[:-1].to(x_dtype)
        if ctx.needs_input_grad[1]:
            padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
            per_offset = [None] * 27
            per_offset[CENTRE] = x.T @ grad
            for k, r, c in zip(OFF_CENTRE, rows, cols):
                per_offset[k] = padded[c].T @ grad_padded[r]
            grad_w = torch.stack(per_offset).view_as(weight).to(weight.dtype)
        return (grad_x, grad_w) + (None,) * len(index)


class _NeighbourGather(torch.autograd.Function):
    """``x`` gathered at a symmetric 3x3x3 neighbour map: [N, C] -> [N, 27, C] (zeros where none).

    The backward is a gather too: voxel j is voxel i's neighbour at offset k exactly when i
    is j's at offset -k, which is column 26 - k of the map, so the gradient of row j sums
    ``grad[map[j, 26 - k], k]``. Autograd's own backward of the gather scatter-adds 27
    rows per voxel into shared rows: slower on the CPU, and summed in thread order.
    """

    @staticmethod
    def forward(x, neighbours):
        return torch.cat([x, x.new_zeros(1, x.shape[1])])[neighbours]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (neighbours,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        columns = torch.arange(27, device=grad.device)
        return padded[neighbours.flip(1), columns].sum(1), None


class DropPath(nn.Module):
    """Stochastic depth per point: a residual branch is dropped for a random subset of rows."""

    def __init__(self, p: float):
        super().__init__()
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = (torch.rand(x.shape[0], 1, device=x.device) >= self.p).to(x.dtype)
        return x * keep / (1.0 - self.p)


class PatchAttention(nn.Module):
    """Multi-head self-attention inside the padded patches of one serialization order."""

    def __init__(self, channels: int, heads: int):
        super().__init__()
        if channels % heads:
            raise ValueError(f"channels ({channels}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, patches: torch.Tensor, slots: torch.Tensor,
                pads: Optional[torch.Tensor] = None) -> torch.Tensor:
        m, k = patches.shape
        c = x.shape[1]
        qkv = self.qkv(x)
        if pads is None:
            qkv = qkv.index_select(0, patches.flatten())
        else:
            qkv = _PatchGather.apply(qkv, patches.flatten(), slots, pads)
        qkv = qkv.reshape(m, k, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [M, H, K, d]
        out = out.transpose(1, 2).reshape(m * k, c)
        out = out.index_select(0, slots) if pads is None else _GatherUnique.apply(out, slots)
        return self.proj(out)


# The gradients of the two patch gathers as gathers and plain stores. Autograd's own (an
# accumulating scatter into zeros) becomes atomic adds over every row in compiled CPU code;
# only the repeated slots need adding.
class _PatchGather(torch.autograd.Function):
    """``values[patches]`` for the flattened padded patches; ``slots`` [N] each point's own
    slot, ``pads`` the slots that repeat a point (ending with two past the end)."""

    @staticmethod
    def forward(values, patches, slots, pads):
        return values.index_select(0, patches)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, grad):
        patches, slots, pads = ctx.saved_tensors
        # Each point's own slot, then the repeats added in: a point past the end (the
        # padding of pads) is point 0 receiving a zero row.
        grad_padded = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])
        points = torch.cat([patches, patches.new_zeros(1)])[pads]
        return grad.index_select(0, slots).index_add(0, points, grad_padded[pads]), None, None, None


class _GatherUnique(torch.autograd.Function):
    """``x[rows]`` for ``rows`` without repeats: the gradient is stored, not accumulated."""

    @staticmethod
    def forward(x, rows):
        return x.index_select(0, rows)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0].new_empty(inputs[0].shape[0], 0), inputs[1])  # x's row count

    @staticmethod
    def backward(ctx, grad):
        like, rows = ctx.saved_tensors
        return grad.new_zeros(like.shape[0], grad.shape[1]).index_put((rows,), grad), None


class Block(nn.Module):
    """Conditional positional encoding, then pre-norm patch attention and MLP, with drop path."""

    def __init__(self, channels: int, heads: int, order_index: int, mlp_ratio: float, drop_path: float):
        super().__init__()
        self.order_index = order_index
        self.cpe = SubMConv(channels, channels)
        self.cpe_proj = nn.Linear(channels, channels)
        self.cpe_norm = nn.LayerNorm(channels)
        self.norm1 = nn.LayerNorm(channels)
        self.attn = PatchAttention(channels, heads)
        self.norm2 = nn.LayerNorm(channels)
        hidden = int(channels * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(channels, hidden), nn.GELU(), nn.Linear(hidden, channels))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, level: dict) -> torch.Tensor:
        x = x + self.cpe_norm(self.cpe_proj(self.cpe(x, level["neighbours"], level.get("pairs"))))
        o = self.order_index % len(level["patches"])
        attn = self.attn(self.norm1(x), level["patches"][o], level["slots"][o], level.get("pads"))
        x = x + self.drop_path(attn)
        return x + self.drop_path(self.mlp(self.norm2(x)))


def _dense(cin: int, cout: int, norm: str) -> nn.Sequential:
    return nn.Sequential(nn.Linear(cin, cout), make_norm(norm, cout), nn.GELU())


class GridPool(nn.Module):
    """Stride-2 grid pooling: project, then max over the points of each coarse voxel."""

    def __init__(self, cin: int, cout: int, norm: str):
        super().__init__()
        self.proj = nn.Linear(cin, cout)
        self.norm = make_norm(norm, cout)

    def forward(self, x: torch.Tensor, cluster: torch.Tensor, num_coarse: int) -> torch.Tensor:
        h = self.proj(x)
        pooled = h.new_zeros(num_coarse, h.shape[1]).scatter_reduce(
            0, cluster.unsqueeze(1).expand_as(h), h, reduce="amax", include_self=False)
        return F.gelu(self.norm(pooled))


class GridUnpool(nn.Module):
    """Unpooling with a skip: coarse features gathered back to their points plus the skip's."""

    def __init__(self, coarse: int, skip: int, cout: int, norm: str):
        super().__init__()
        self.proj = _dense(coarse, cout, norm)
        self.proj_skip = _dense(skip, cout, norm)

    def forward(self, coarse: torch.Tensor, skip: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        return self.proj(coarse).index_select(0, cluster) + self.proj_skip(skip)


class _Stage(nn.Module):
    def __init__(self, resample: Optional[nn.Module], channels: int, depth: int, heads: int, mlp_ratio: float,
                 drop_paths: Sequence[float]):
        super().__init__()
        self.resample = resample
        self.blocks = nn.ModuleList(Block(channels, heads, i, mlp_ratio, drop_paths[i]) for i in range(depth))

    def run_blocks(self, x: torch.Tensor, level: dict) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, level)
        return x


class PTv3(nn.Module):
    """Point Transformer V3-class U-Net for point-cloud semantic segmentation.

    in_channels / num_classes: per-point features in, classes out.
    enc_depths, enc_channels, enc_heads: blocks, width and attention heads per encoder
        level (level 0 at the input voxels; each later level pooled by stride 2).
    dec_depths, dec_channels, dec_heads: the same per decoder level 0 .. L-2 (level l
        unpools to encoder level l's points); the head reads ``dec_channels[0]``.
    patch_size: K per level (an int for all); orders, shuffle_orders: serialization
        (:class:`~pimm_fn.models.serialization.TopologySpec`). mlp_ratio, drop_path:
        the MLP width factor and the largest stochastic-depth rate (linear over encoder
        blocks, as in PTv3). norm: "batch" (PTv3's) or "layer" for the embedding, pooling
        and unpooling (the blocks always use LayerNorm). label_key: the labels' batch key. loss: "ce" or "ce+lovasz".
    trace_conv: trace the positional-encoding convolutions into a compiled step (faster
        compiled steps, a longer cold compile) instead of calling each as one op
        (:class:`SubMConv`'s ``trace``).
    The defaults are PTv3's base configuration with patches of 128 points.
    """

    label_key = "segment"

    def __init__(self, in_channels: int, num_classes: int, *,
                 enc_depths: Sequence[int] = (2, 2, 2, 6, 2), enc_channels: Sequence[int] = (32, 64, 128, 256, 512),
                 enc_heads: Sequence[int] = (2, 4, 8, 16, 32), dec_depths: Sequence[int] = (2, 2, 2, 2),
                 dec_channels: Sequence[int] = (64, 64, 128, 256), dec_heads: Sequence[int] = (4, 4, 8, 16),
                 patch_size=128, orders: Sequence[str] = ORDERS, shuffle_orders: bool = True,
                 mlp_ratio: float = 4.0, drop_path: float = 0.3, norm: str = "batch", loss: str = "ce",
                 class_weight: Optional[Sequence[float]] = None, trace_conv: bool = False):
        super().__init__()
        levels = len(enc_depths)
        for name, value in (("enc_channels", enc_channels), ("enc_heads", enc_heads)):
            _per_level(value, levels, name)
        for name, value in (("dec_depths", dec_depths), ("dec_channels", dec_channels), ("dec_heads", dec_heads)):
            _per_level(value, levels - 1, name)
        if loss not in ("ce", "ce+lovasz"):
            raise ValueError(f"loss must be 'ce' or 'ce+lovasz', got {loss!r}")
        self.spec = TopologySpec(_per_level(patch_size, levels, "patch_size"), tuple(orders), shuffle_orders)
        self.loss = loss
        self.register_buffer("class_weight", None if class_weight is None
                             else torch.tensor(class_weight, dtype=torch.float32), persistent=False)
        rates = torch.linspace(0, drop_path, sum(enc_depths)).tolist()
        self.embedding = nn.ModuleDict({"conv": SubMConv(in_channels, enc_channels[0], bias=False),
                                        "norm": make_norm(norm, enc_channels[0])})
        self.enc = nn.ModuleList()
        for i in range(levels):
            pool = GridPool(enc_channels[i - 1], enc_channels[i], norm) if i else None
            first = sum(enc_depths[:i])
            self.enc.append(_Stage(pool, enc_channels[i], enc_depths[i], enc_heads[i], mlp_ratio,
                                   rates[first:first + enc_depths[i]]))
        self.dec = nn.ModuleList()
        for i in range(levels - 1):
            coarse = enc_channels[-1] if i == levels - 2 else dec_channels[i + 1]
            unpool = GridUnpool(coarse, enc_channels[i], dec_channels[i], norm)
            self.dec.append(_Stage(unpool, dec_channels[i], dec_depths[i], dec_heads[i], mlp_ratio,
                                   [0.0] * dec_depths[i]))
        self.head = nn.Linear(dec_channels[0] if levels > 1 else enc_channels[0], num_classes)
        for module in self.modules():
            if isinstance(module, SubMConv):
                module.trace = trace_conv

    def collate(self, mix_prob: float = 0.0) -> "PTv3Collate":
        """The point collate that also builds this model's topology (in the loader's workers)."""
        return PTv3Collate(self.spec, mix_prob)

    def topology(self, batch: dict) -> dict:
        """The batch's topology: the one it carries, or computed here (orders not shuffled)."""
        if "topology" in batch:
            return batch["topology"]
        spec = TopologySpec(self.spec.patch_sizes, self.spec.orders, False, self.spec.stride)
        return build_topology(batch["grid_coord"], batch["offset"], spec)

    def encode(self, batch: dict, levels: list) -> list:
        """The encoder: each level's point features, finest first (the last is the bottleneck)."""
        emb = self.embedding
        x = F.gelu(emb["norm"](emb["conv"](batch["feat"], levels[0]["neighbours"], levels[0].get("pairs"))))
        skips = []
        for i, stage in enumerate(self.enc):
            if i:
                x = stage.resample(x, levels[i - 1]["pool"], levels[i]["neighbours"].shape[0])
            x = stage.run_blocks(x, levels[i])
            skips.append(x)
        return skips

    def decode(self, skips: list, levels: list) -> torch.Tensor:
        """The decoder from the encoder's features back to the finest level's points."""
        x = skips[-1]
        for i in reversed(range(len(self.dec))):
            stage = self.dec[i]
            x = stage.run_blocks(stage.resample(x, skips[i], levels[i]["pool"]), levels[i])
        return x

    def forward(self, batch: dict) -> dict:
        levels = self.topology(batch)["levels"]
        logits = self.head(self.decode(self.encode(batch, levels), levels))
        out = classification_outputs(logits, batch, self.label_key, "seg_logits", weight=self.class_weight)
        if self.loss == "ce+lovasz" and "loss" in out:
            from .losses import lovasz_softmax

            out["loss"] = out["loss"] + lovasz_softmax(logits.float(), batch[self.label_key])
        return out


class PTv3Collate(PointCollate):
    """Point collate (Mix3D as :class:`~pimm_fn.data.collate.PointCollate`) plus the batch's
    PTv3 topology under ``"topology"``; the order shuffle is drawn from the batch's seed,
    so it is the same on resume and with any worker count."""

    def __init__(self, spec: TopologySpec, mix_prob: float = 0.0):
        super().__init__(mix_prob)
        self.spec = spec

    def __call__(self, batch):
        out = super().__call__(batch)
        seed = batch[0].get("_mix_seed") if batch and isinstance(batch[0], dict) else None
        generator = torch.Generator().manual_seed(int(seed) ^ 0x5DEECE66D) if seed is not None else None
        out["topology"] = build_topology(out["grid_coord"], out["offset"], self.spec, generator)
        return out


def layer_decay_groups(model: PTv3, lr: float, decay: float, **settings) -> list:
    """Layer-wise learning-rate decay as param groups: one group per block, deeper = larger lr.

    Layers are numbered from the input: the embedding 0, then every encoder level's pooling
    and blocks, then the decoder's unpooling and blocks, the head last. A layer i of L
    trains at ``lr * decay ** (L - i)``. Each group is Pointcept's ``param_dicts`` entry
    (keyword, lr, name; ``settings`` such as weight_decay added to each), for
    :func:`pimm_fn.optim.grouped` / :func:`pimm_fn.recipes.adamw_one_cycle`.
    """
    keywords = ["embedding."]
    for part in ("enc", "dec"):
        stages = getattr(model, part)
        order = range(len(stages)) if part == "enc" else reversed(range(len(stages)))
        for i in order:
            if stages[i].resample is not None:
                keywords.append(f"{part}.{i}.resample.")
            keywords += [f"{part}.{i}.blocks.{j}." for j in range(len(stages[i].blocks))]
    keywords.append("head.")
    last = len(keywords) - 1
    return [{"keyword": k, "lr": lr * decay ** (last - i), "name": k.rstrip("."), **settings}
            for i, k in enumerate(keywords)]
