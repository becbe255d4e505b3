"""Recipes: the pieces every experiment used to write out again, named once.

An experiment file then says only what is particular to it (its data, model and
settings). Each recipe is a thin composition of the engine's public parts:

    adamw_one_cycle     AdamW, OneCycle learning rate, beta1 cycled against it
                        (Pointcept's default optimizer and scheduler), param groups optional
    supervised_step     the supervised step, data-parallel under torchrun, compiled
    point_predictions   an ``Evaluate`` eval_fn: argmax labels at full resolution
    segmentation_eval   an ``Evaluate`` over a point-cloud loader with a SegmentationMetric
    render_first_cloud  a run's picture: a validation cloud by prediction beside its truth
    ptv3_unet           a PTv3 sized by its encoder widths (the decoder mirrors them)
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from . import optim, schedules
from .callbacks.evaluation import Evaluate
from .compile import compile_step
from .metrics import SegmentationMetric
from .steps.common import eval_forward
from .steps.parallel import data_parallel

__all__ = ["adamw_one_cycle", "point_predictions", "ptv3_unet", "render_first_cloud", "segmentation_eval",
           "supervised_step"]


def adamw_one_cycle(total_steps: int, lr: float, *, weight_decay: float, pct_start: float = 0.3,
                    div_factor: float = 10.0, final_div_factor: float = 1000.0,
                    groups: Sequence[Mapping] = ()):
    """AdamW whose lr follows OneCycle to ``lr`` (each group's own peak with ``groups``) and
    whose beta1 cycles the other way, as torch's OneCycleLR(cycle_momentum=True) does.

    groups: Pointcept's ``param_dicts`` (``{"keyword": "head", "lr": 1e-2}``...); see
    :func:`pimm_fn.optim.grouped`.
    """
    b1 = schedules.one_cycle_momentum(total_steps, pct_start=pct_start)

    def cycle(max_lr):
        return schedules.one_cycle(total_steps, max_lr, pct_start=pct_start, div_factor=div_factor,
                                   final_div_factor=final_div_factor)

    if groups:
        return optim.grouped(optim.adamw, list(groups), lr=lr, weight_decay=weight_decay, lr_schedule=cycle, b1=b1)
    return optim.adamw(lr=cycle(lr), weight_decay=weight_decay, b1=b1)


def supervised_step(*, compile: bool = True, **options):
    """``data_parallel(**options)`` (the plain supervised step in a single process; gradients
    averaged over ranks under torchrun), through ``compile_step`` unless ``compile=False``.

    options: clip_grad, autocast, sync_buffers, ... as for :func:`pimm_fn.steps.parallel.data_parallel`.
    """
    step = data_parallel(**options)
    return compile_step(step) if compile else step


def point_predictions(input_keys: Sequence[str], logits_key: str = "seg_logits"):
    """``eval_fn(state, batch) -> {"pred", "target"}`` for :class:`~pimm_fn.callbacks.Evaluate`.

    The model sees only ``input_keys`` of the batch. With ``inverse`` and
    ``origin_segment`` in the batch (a voxelised test transform), the voxel predictions are
    mapped back to every original point; otherwise they are scored at the voxels
    against ``segment``.
    """
    keys = tuple(input_keys)

    def eval_fn(state, batch):
        pred = eval_forward(state, {k: batch[k] for k in keys})[logits_key].argmax(-1)
        if "inverse" in batch and "origin_segment" in batch:
            return {"pred": pred[batch["inverse"]], "target": batch["origin_segment"]}
        return {"pred": pred, "target": batch["segment"]}

    return eval_fn


def segmentation_eval(loader, input_keys: Sequence[str], num_classes: int, names: Optional[Sequence[str]] = None,
                      *, name: str = "val", logits_key: str = "seg_logits", **metric_options) -> Evaluate:
    """An :class:`~pimm_fn.callbacks.Evaluate` of semantic segmentation over ``loader``.

    metric_options: classes / present / per_class of :class:`pimm_fn.metrics.SegmentationMetric`.
    ``.metrics(state)`` evaluates once; as a callback it evaluates on its schedule.
    """
    metric = SegmentationMetric(num_classes, names=names, **metric_options)
    return Evaluate(point_predictions(input_keys, logits_key), loader, metric=metric, name=name)


def render_first_cloud(state, loader, png, input_keys: Sequence[str], class_names: Sequence[str], title: str,
                       logits_key: str = "seg_logits") -> None:
    """The first cloud of ``loader``'s first batch coloured by prediction beside its ground
    truth (a top view, :func:`pimm_fn.report.render_point_cloud`) into ``png``."""
    from .report import render_point_cloud

    batch = next(iter(loader.iter_epoch(0, 0)))
    out = eval_forward(state, {k: batch[k] for k in input_keys})
    n = int(batch["offset"][0])
    pred = out[logits_key].argmax(-1)[:n]
    render_point_cloud(batch["coord"][:n], pred, batch["segment"][:n], png, class_names,
                       title=f"{title}, step {int(state.step)}")


def ptv3_unet(in_channels: int, num_classes: int, *, channels: Sequence[int], depths: Sequence[int],
              dec_depths: Sequence[int], head_channels: int = 16, **options):
    """:class:`pimm_fn.models.PTv3` with ``channels`` per encoder level, the decoder at the
    same widths (its deepest level excepted) and one attention head per ``head_channels``.

    options: patch_size, drop_path, loss, ... as for PTv3.
    """
    from .models.ptv3 import PTv3

    ch = list(channels)
    dec = ch[:len(ch) - 1]
    return PTv3(in_channels, num_classes,
                enc_depths=depths, enc_channels=ch, enc_heads=[c // head_channels for c in ch],
                dec_depths=dec_depths, dec_channels=dec, dec_heads=[c // head_channels for c in dec], **options)
