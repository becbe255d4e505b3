"""Data layer: collate, resumable sampler, loaders, multi-dataset mixing, transforms, data sets
(including generated LArTPC particle-imaging events).

Everything here feeds ``fit`` through the loader protocol documented in
:mod:`pimm_fn.data.loaders`; nothing here depends on steps or optimizers.
"""
from . import transforms
from .collate import (
    InstanceCollate,
    PointCollate,
    collate,
    image_collate,
    instance_collate,
    mix3d,
    point_collate,
    validate_batch,
    validate_point_batch,
)
from .count import BatchCount, count_batch
from .datasets import (
    DigitsImages,
    FrogTissueBlocks,
    LidarBlocks,
    SyntheticScenes,
    SyntheticStream,
    read_vti,
    synthetic_scene,
)
from .device import DeviceLoader, batch_devices, check_batch_device, to_device
from .dynamic import mark_point_dims_dynamic, pad_points_to_bucket
from .fetch import DatasetMissingError, data_root, fetch, fetch_command
from .lartpc import LArTPCEvents, lartpc_event
from .loaders import (
    EpochLoader,
    build_eval_loader,
    build_train_loader,
    check_nonempty,
    sample_seed,
    seed_worker,
)
from .multi import MultiDatasetLoader, build_multi_loader
from .sampler import ResumableSampler, epoch_order, samples_per_rank

__all__ = [
    "InstanceCollate", "PointCollate", "collate", "image_collate", "instance_collate", "mix3d",
    "point_collate", "validate_batch", "validate_point_batch",
    "BatchCount", "count_batch",
    "DigitsImages", "FrogTissueBlocks", "LidarBlocks", "SyntheticScenes", "SyntheticStream",
    "read_vti", "synthetic_scene",
    "DeviceLoader", "batch_devices", "check_batch_device", "to_device",
    "mark_point_dims_dynamic", "pad_points_to_bucket",
    "DatasetMissingError", "data_root", "fetch", "fetch_command",
    "LArTPCEvents", "lartpc_event",
    "EpochLoader", "build_eval_loader", "build_train_loader", "check_nonempty", "sample_seed", "seed_worker",
    "MultiDatasetLoader", "build_multi_loader",
    "ResumableSampler", "epoch_order", "samples_per_rank",
    "transforms",
]
