"""Models in Pointcept's calling convention: ``model(batch: dict) -> dict``.

Training batches carry labels and the output has ``"loss"`` (the step differentiates it)
plus logits and scalar metrics (``"acc"``; every scalar output is logged). Evaluation
batches without labels give logits only. All models are pure torch, have no host syncs
and compile with ``torch.compile(fullgraph=True)`` inside a pure step.

Policies for GRPO (see :mod:`pimm_fn.models.policies`): a policy is any module exposing
log-probabilities of actions.
"""
from .image import ImageClassifier, MLPClassifier
from .point_seg import PointSegNet, batch_index, voxel_groups
from .policies import CategoricalMLPPolicy, PointLabelPolicy, Policy, gumbel_sample, per_cloud_sum, take_log_prob
from .ptv3 import PTv3, PTv3Collate, layer_decay_groups

__all__ = [
    "PointSegNet",
    "PTv3",
    "PTv3Collate",
    "layer_decay_groups",
    "ImageClassifier",
    "MLPClassifier",
    "PointLabelPolicy",
    "CategoricalMLPPolicy",
    "Policy",
    "batch_index",
    "voxel_groups",
    "per_cloud_sum",
    "gumbel_sample",
    "take_log_prob",
]
