"""The PTv3-class backbone: its topology (curves, patches, neighbours, pooling), the model's
contract, and its whole supervised step compiled once over real LiDAR batches of varying
point counts with 0 graph breaks, equal to eager, layer-wise lr decay without recompiles,
and exact resume through fit + Checkpoint.
"""
import itertools

import pytest
import torch

from pimm_fn import TrainState, fit, recipes
from pimm_fn import events as ev
from pimm_fn.callbacks import Checkpoint, on, resume
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.models.ptv3 import PTv3, _NeighbourGather, layer_decay_groups
from pimm_fn.models.serialization import (
    CENTRE,
    OFF_CENTRE,
    ORDERS,
    TopologySpec,
    build_topology,
    grid_pool,
    hilbert_code,
    neighbour_map,
    neighbour_pairs,
    patch_slots,
    serial_code,
    z_order_code,
)
from pimm_fn.steps.parallel import data_parallel
from pimm_fn.tree import tree_leaves

CUBE8 = torch.tensor(list(itertools.product(range(8), repeat=3)))


@pytest.mark.parametrize("bits", [3, 16])
def test_hilbert_code_walks_face_adjacent_voxels_through_every_voxel_once(bits):
    code = hilbert_code(CUBE8, bits)
    assert code.unique().numel() == 512
    walk = CUBE8[torch.argsort(code)]
    steps = (walk[1:] - walk[:-1]).abs().sum(1)
    assert torch.equal(steps, torch.ones_like(steps))  # each next voxel shares a face


def test_z_order_is_the_bit_interleave_and_trans_swaps_x_and_y():
    assert sorted(z_order_code(CUBE8, 3).tolist()) == list(range(512))
    assert int(z_order_code(torch.tensor([[1, 0, 0]]), 3)) == 4
    assert int(z_order_code(torch.tensor([[0, 0, 1]]), 3)) == 1
    batch = torch.zeros(512, dtype=torch.long)
    assert torch.equal(serial_code(CUBE8, batch, "z-trans"), serial_code(CUBE8[:, [1, 0, 2]], batch, "z"))
    with pytest.raises(ValueError, match="unknown serialization order 'morton'"):
        serial_code(CUBE8, batch, "morton")


def test_serial_codes_keep_each_cloud_contiguous():
    grid = torch.randint(0, 50, (300, 3))
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 120, 80]))
    for order in ORDERS:
        perm = torch.argsort(serial_code(grid, batch, order))
        assert torch.equal(batch[perm], batch)


def test_patch_slots_pad_each_cloud_with_its_own_points():
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 3, 9]))
    source, slot, pads = patch_slots(batch, 3, 4)
    assert source.numel() == 8 + 4 + 12                       # ceil(n / K) * K per cloud
    assert torch.equal(source[slot], torch.arange(17))          # every point has its own slot
    patches = batch[source].reshape(-1, 4)
    assert torch.equal(patches, patches[:, :1].expand_as(patches))  # no patch mixes clouds
    assert source.tolist() == [0, 1, 2, 3, 4, 1, 2, 3, 5, 6, 7, 5, 8, 9, 10, 11, 12, 13, 14, 15, 16, 13, 14, 15]
    assert pads.tolist() == [5, 6, 7, 11, 21, 22, 23, 24, 24]  # the repeating slots, then two past the end


def test_neighbour_map_equals_brute_force_and_is_symmetric():
    grid = torch.unique(torch.randint(0, 6, (200, 3)), dim=0)
    batch = (torch.arange(len(grid)) >= len(grid) // 2).long()
    nb = neighbour_map(grid, batch)
    n = len(grid)
    cube = list(itertools.product((-1, 0, 1), repeat=3))
    where = {(int(b), *map(int, g)): i for i, (g, b) in enumerate(zip(grid, batch))}
    for i in range(n):
        for k, (dx, dy, dz) in enumerate(cube):
            key = (int(batch[i]), int(grid[i, 0]) + dx, int(grid[i, 1]) + dy, int(grid[i, 2]) + dz)
            assert int(nb[i, k]) == where.get(key, n)
            if where.get(key, n) < n:
                assert int(nb[nb[i, k], 26 - k]) == i  # what the gather's backward relies on


def test_neighbour_gather_backward_is_the_true_gradient():
    grid = torch.unique(torch.randint(0, 5, (120, 3)), dim=0)
    nb = neighbour_map(grid, torch.zeros(len(grid), dtype=torch.long))
    x = torch.randn(len(grid), 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _NeighbourGather.apply(t, nb), (x,))


def test_neighbour_pairs_list_each_present_neighbour_once_per_offset():
    grid = torch.unique(torch.randint(0, 6, (150, 3)), dim=0)
    nb = neighbour_map(grid, torch.zeros(len(grid), dtype=torch.long))
    pairs, n = neighbour_pairs(nb), len(grid)
    assert OFF_CENTRE == tuple(k for k in range(27) if k != CENTRE)
    assert len(pairs["rows"]) == len(pairs["cols"]) == 26
    for k, rows, cols in zip(OFF_CENTRE, pairs["rows"], pairs["cols"]):
        real_rows, real_cols = rows[:-2], cols[:-2]
        assert rows[-2:].tolist() == cols[-2:].tolist() == [n, n]  # the padding row
        assert torch.equal(real_cols, nb[real_rows, k]) and bool((real_cols < n).all())
        assert len(set(real_rows.tolist())) == len(real_rows) == int((nb[:, k] < n).sum())
        assert len(set(real_cols.tolist())) == len(real_cols)  # what the gradient's plain stores rely on


@pytest.mark.parametrize("cin", [4, 16])
def test_sparse_submconv_equals_the_dense_gather_form(cin):
    from pimm_fn.models.ptv3 import SubMConv

    grid = torch.unique(torch.randint(0, 7, (300, 3)), dim=0)
    batch = (torch.arange(len(grid)) >= len(grid) // 3).long()
    nb = neighbour_map(grid, batch)
    torch.manual_seed(0)
    conv = SubMConv(cin, 8).double()
    x = torch.randn(len(grid), cin, dtype=torch.float64, requires_grad=True)
    dense = conv(x, nb)
    sparse = conv(x, nb, neighbour_pairs(nb))
    assert torch.allclose(dense, sparse, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(dense.sin().sum(), [x, conv.weight, conv.bias]),
                    torch.autograd.grad(sparse.sin().sum(), [x, conv.weight, conv.bias])):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_traced_and_op_forms_of_the_convolution_give_the_same_bits():
    # trace=True: a compiled step traces the per-offset loop (no op in the graph); eager
    # calls and trace=False call the op. Both are the same additions in the same order.
    from torch._dynamo.testing import CompileCounterWithBackend

    from pimm_fn.models.ptv3 import SubMConv

    grid = torch.unique(torch.randint(0, 7, (300, 3)), dim=0)
    pairs = neighbour_pairs(neighbour_map(grid, torch.zeros(len(grid), dtype=torch.long)))
    results, ops_in_graph = [], []
    for trace in (False, True):
        torch.manual_seed(0)
        conv = SubMConv(8, 8, trace=trace)
        x = torch.randn(len(grid), 8)
        counter = CompileCounterWithBackend("aot_eager")
        out = torch.compile(conv, fullgraph=True, backend=counter)(x, None, pairs)
        results.append((out, conv(x, None, pairs)))
        ops_in_graph.append(sum(n.target == torch.ops.pimm_fn.neighbour_conv.default
                                for n in counter.graphs[0].graph.nodes))
    assert ops_in_graph == [1, 0]
    (op_compiled, op_eager), (traced_compiled, traced_eager) = results
    assert torch.equal(op_compiled, op_eager) and torch.equal(op_eager, traced_eager)
    assert torch.equal(traced_compiled, op_eager)


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_sparse_submconv_back_propagates_under_bfloat16_autocast(input_dtype):
    # Under autocast the forward's products run in bfloat16 and a block's input may itself
    # be bfloat16; the backward runs outside autocast and must not mix dtypes.
    from pimm_fn.models.ptv3 import SubMConv

    grid = torch.unique(torch.randint(0, 7, (300, 3)), dim=0)
    nb = neighbour_map(grid, torch.zeros(len(grid), dtype=torch.long))
    torch.manual_seed(0)
    conv = SubMConv(8, 8)
    x = torch.randn(len(grid), 8).to(input_dtype).requires_grad_(True)
    reference = torch.autograd.grad(conv(x.float(), nb, neighbour_pairs(nb)).sum(), [conv.weight])[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x, nb, neighbour_pairs(nb))
    grad_x, grad_w = torch.autograd.grad(out.float().sum(), [x, conv.weight])
    assert grad_x.dtype == input_dtype and grad_w.dtype == torch.float32
    assert torch.allclose(grad_w, reference, rtol=0.05, atol=0.05 * float(reference.abs().max()))


def test_patch_attention_gradients_through_the_repeated_slots_equal_autograds():
    # Clouds smaller than K repeat points several times, larger ones once: both kinds of
    # repeat go through _PatchGather's backward; a cloud of exactly K repeats none.
    from pimm_fn.models.ptv3 import PatchAttention

    grid = torch.unique(torch.randint(0, 9, (400, 3)), dim=0)[:75]
    batch = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 16, 3, 51]))
    topology = build_topology(grid, torch.tensor([5, 21, 24, 75]), TopologySpec((16,), shuffle_orders=False))
    level = topology["levels"][0]
    assert int(level["patches"][0].numel() - batch.numel()) == len(level["pads"]) - 2
    torch.manual_seed(0)
    attn = PatchAttention(8, 2).double()
    x = torch.randn(len(grid), 8, dtype=torch.float64, requires_grad=True)
    for order in range(len(level["patches"])):
        args = (level["patches"][order], level["slots"][order])
        plain, ours = attn(x, *args), attn(x, *args, level["pads"])
        assert torch.equal(plain, ours)
        params = [x, *attn.parameters()]
        for a, b in zip(torch.autograd.grad(plain.sin().sum(), params), torch.autograd.grad(ours.sin().sum(), params)):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_grid_pool_merges_the_voxels_of_each_cloud_only():
    grid = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 0, 0], [0, 0, 0], [3, 1, 1]])
    batch = torch.tensor([0, 0, 0, 1, 1])
    cluster, coarse, coarse_batch = grid_pool(grid, batch)
    assert cluster.tolist() == [0, 0, 1, 2, 3]
    assert coarse.tolist() == [[0, 0, 0], [1, 0, 0], [0, 0, 0], [1, 0, 0]] and coarse_batch.tolist() == [0, 0, 1, 1]


# --------------------------------------------------------------------------- the model

TINY = dict(enc_depths=(1, 1), enc_channels=(16, 32), enc_heads=(2, 4), dec_depths=(1,), dec_channels=(16,),
            dec_heads=(2,), patch_size=(32, 16))


def _clouds(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in sizes:
        grid = torch.unique(torch.randint(0, 24, (n, 3), generator=g), dim=0)
        samples.append({"coord": grid.float() * 0.1, "grid_coord": grid, "feat": torch.randn(len(grid), 4, generator=g),
                        "segment": torch.randint(-1, 3, (len(grid),), generator=g), "_mix_seed": seed})
    return samples


def test_forward_contract_and_topology_inside_equals_the_loaders():
    torch.manual_seed(0)
    model = PTv3(4, 3, shuffle_orders=False, drop_path=0.0, **TINY).eval()
    batch = model.collate()(_clouds([300, 500]))
    out = model(batch)
    assert out["seg_logits"].shape == (batch["coord"].shape[0], 3) and out["loss"].dim() == 0
    inside = model({k: v for k, v in batch.items() if k != "topology"})  # computed in the forward
    assert torch.equal(inside["seg_logits"], out["seg_logits"])
    assert "loss" not in model({k: v for k, v in batch.items() if k != "segment"})


def test_bad_configs_name_the_setting():
    with pytest.raises(ValueError, match="enc_channels needs one value per level"):
        PTv3(4, 3, enc_depths=(1, 1), enc_channels=(16,))
    with pytest.raises(ValueError, match="multiple of heads"):
        PTv3(4, 3, **{**TINY, "enc_heads": (3, 4)})
    with pytest.raises(ValueError, match="orders must be"):
        TopologySpec((16,), orders=("peano",))


def test_layer_decay_groups_one_per_block_deeper_gets_more():
    model = PTv3(4, 3, **TINY)
    groups = layer_decay_groups(model, 1e-3, 0.5, weight_decay=0.05)
    names = [g["name"] for g in groups]
    assert names == ["embedding", "enc.0.blocks.0", "enc.1.resample", "enc.1.blocks.0", "dec.0.resample",
                     "dec.0.blocks.0", "head"]
    assert groups[-1]["lr"] == 1e-3 and groups[0]["lr"] == pytest.approx(1e-3 * 0.5 ** 6)
    claimed = {n for n, _ in model.named_parameters() if any(g["keyword"] in n for g in groups)}
    assert claimed == {n for n, _ in model.named_parameters()}  # no parameter left in the default group


# --------------------------------------------------------------------------- compiled over real LiDAR batches


@pytest.fixture(scope="module")
def lidar():
    from pimm_fn.data import LidarBlocks, build_train_loader
    from pimm_fn.experiment import load_experiment

    try:
        dataset = LidarBlocks("train")
    except Exception as err:
        pytest.skip(str(err))
    # One thread for the whole module: the compiled kernels keep the thread count they were
    # built with, and the backward's scatter-adds sum in thread order on more than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = PTv3(4, 3, drop_path=0.0, **TINY)
    transform = load_experiment("ptv3_seg").transform(0.25, "train")
    loader = build_train_loader(dataset, batch_size=2, seed=0, transform=transform, collate_fn=model.collate(),
                                iters_per_epoch=4)
    total = 12
    tx = recipes.adamw_one_cycle(total, 2e-3, weight_decay=0.05, groups=layer_decay_groups(model, 2e-3, 0.8))
    state = TrainState.create(model, tx, seed=0)
    step = compile_step(data_parallel(clip_grad=1.0))
    yield model, loader, state, step
    torch.set_num_threads(threads)


def test_whole_step_compiles_once_with_no_graph_break_and_equals_eager(lidar):
    model, loader, state, step = lidar
    batches = list(loader.iter_epoch(0, 0))
    sizes = [b["coord"].shape[0] for b in batches]
    assert len(set(sizes)) == len(sizes)  # every point count differs
    explained = explain_step(data_parallel(clip_grad=1.0), state, batches[1])  # (explaining resets dynamo)
    assert explained.graph_break_count == 0 and not explained.break_reasons
    eager_state, eager = data_parallel(clip_grad=1.0)(state, batches[0])
    new, compiled = step(state, batches[0])
    assert abs(float(compiled["loss"]) - float(eager["loss"])) <= 1e-5
    lrs = []
    for b in batches[1:] + batches:
        new, m = step(new, b)
        lrs.append((float(m["lr/head"]), float(m["lr/embedding"])))
    assert step.compile_count == 1, step.recompile_reasons
    # every group's OneCycle moved every step, each at its own decayed peak, without a recompile
    assert len({head for head, _ in lrs}) == len(lrs)
    assert all(emb == pytest.approx(head * 0.8 ** 6, rel=1e-5) for head, emb in lrs)


def test_compiled_run_stopped_and_resumed_equals_the_uninterrupted_run(lidar, tmp_path):
    model, loader, state, step = lidar
    full = fit(state, loader, step, epochs=3).state
    first = fit(state, loader, step, epochs=3, callbacks=[on(ev.StepEnd, once=6)(lambda e, s: ev.Stop("half")),
                                                          Checkpoint(tmp_path, every_epochs=None)])
    assert int(first.state.step) == 6
    restored = resume(tmp_path, state, loader=loader)  # as a fresh process would: from disk
    second = fit(restored, loader, step, epochs=3).state
    assert int(second.step) == int(full.step) == 12 and step.compile_count == 1, step.recompile_reasons
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(second), tree_leaves(full))
               if isinstance(a, torch.Tensor))
