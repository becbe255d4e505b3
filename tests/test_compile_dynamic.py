"""Variable-size point batches under the compiled step: bounded compilations."""
import torch

from pimm_fn import optim
from pimm_fn.compile import compile_step
from pimm_fn.data import SyntheticScenes, build_train_loader, transforms as T
from pimm_fn.models import PointSegNet
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised


def test_300_steps_with_point_counts_varying_50_percent_compile_at_most_3_times():
    # Scenes of 500..1500 points (+-50% around 1000), two per batch: every batch's total differs.
    data = SyntheticScenes(num_scenes=40, seed=7, points=(500, 1500))
    loader = build_train_loader(data, batch_size=2, seed=0,
                                transform=T.compose(T.grid_sample(0.05), T.assemble_feat(("coord",))))
    model = PointSegNet(in_channels=3, num_classes=SyntheticScenes.num_classes, width=8, strides=(2, 4))
    state = TrainState.create(model, optim.adamw(lr=1e-3))
    step = compile_step(supervised(clip_grad=1.0))
    sizes = set()
    epoch = 0
    steps = 0
    while steps < 300:
        for batch in loader.iter_epoch(epoch, 0):
            sizes.add(int(batch["offset"][-1]))
            state, metrics = step(state, batch)
            steps += 1
            if steps == 300:
                break
        epoch += 1
    assert len(sizes) > 100, "the test must really vary the point count"
    assert step.compile_count <= 3, step.recompile_reasons
    assert torch.isfinite(metrics["loss"])
    assert int(state.step) == 300
