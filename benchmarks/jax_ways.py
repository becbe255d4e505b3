"""The benchmark models in JAX (jit + optax), for ``run_steps.py``'s ``jax`` way.

Each model is reimplemented from the torch module it mirrors (its layer sizes are read
from the module, its initial weights copied from its ``state_dict``), so both start from
the same point and the first loss of a JAX step equals the first loss of a torch step:

- ``MLPClassifier``: Linear-ReLU stack, mean cross-entropy.
- ``ImageClassifier``: conv3x3 (no bias) - BatchNorm2d - ReLU blocks (stride 2 after the
  first), global average pool, Linear. JAX's usual NHWC layout (HWIO kernels): images
  are transposed once, on the host, when the batch is converted.
- ``PointSegNet``: stem, voxel stages (sort-based voxel grouping, centroid offsets,
  ``jax.ops.segment_sum`` / ``segment_max`` pooling gathered back to the points), head,
  BatchNorm1d over the points, masked cross-entropy. ``jit`` compiles once per input
  shape, so point batches are padded to the next multiple of :data:`POINT_BUCKET` with a
  validity mask: padded points sit in a cloud of their own (id B), are left out of the
  BatchNorm statistics and carry label -1 (ignored by the loss). Each bucket compiles once.

Training matches the torch ways: BatchNorm in training mode (batch statistics, running
mean/var updated with momentum 0.1 and the unbiased variance), then
``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(one_cycle, weight_decay=0.01))``
with :func:`one_cycle` equal to ``pimm_fn.schedules.one_cycle`` / torch's OneCycleLR.
One difference in the clip: torch scales by ``max_norm / (norm + 1e-6)``, optax by
``max_norm / norm`` (a 1e-6 relative difference, on clipped steps only).

jax and optax are optional (``pip install -e ".[bench]"``); :func:`available` says
whether they import. Call :func:`configure_threads` before anything touches JAX's
backend: the CPU client fixes its thread count once, when it starts.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional

import numpy as np

POINT_BUCKET = 1024  # point batches are padded to the next multiple of this
BN_EPS = 1e-5
BN_MOMENTUM = 0.1
FIRST_LOSS_TOL = 1e-4


def available() -> tuple:
    """(True, versions) when jax and optax import, else (False, the reason and the fix)."""
    try:
        import jax
        import optax
    except ImportError as e:
        return False, f"jax/optax not importable ({e}); install the extra: pip install -e '.[bench]'"
    return True, f"jax {jax.__version__}, optax {optax.__version__}"


def configure_threads(threads: Optional[int]) -> dict:
    """Start JAX's CPU client with ``threads`` compute threads (the torch ways' setting).

    ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"`` (the
    usual advice) does NOT do it in jax 0.10: measured here, a jitted 2048^2 matmul still
    ran at 1.95 CPU-seconds per second on 2 cores. The client sizes its thread pool from
    the process's CPU affinity when it starts, so the client is started while this thread
    is pinned to ``threads`` cores, and every thread's affinity is then restored (no thread
    stays pinned to one core). Measured after this: 1.0 CPU-s/s. Call it before anything
    else touches JAX's backend; None leaves JAX alone (all cores). Returns what was done.
    """
    import jax

    full = os.sched_getaffinity(0)
    if not threads or threads >= len(full):
        jax.devices()
        return {"threads": len(full), "method": "default (all cores in the affinity mask)"}
    os.sched_setaffinity(0, set(sorted(full)[:threads]))
    try:
        jax.devices()  # starts the CPU client: its pool is sized from the mask now in force
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), full)
            except OSError:  # a thread that ended meanwhile
                pass
    return {"threads": threads, "method": "CPU client started under a %d-core affinity mask, mask restored" % threads}


def peak_gemm_gflops(n=2048, reps=6) -> dict:
    """XLA's float32 n x n matmul rate under jit (best and median of ``reps`` products)."""
    import time

    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n**3
    return {"n": n, "best_gflops": flops / min(times) / 1e9,
            "median_gflops": flops / sorted(times)[len(times) // 2] / 1e9}


# --------------------------------------------------------------------------------------
# schedule and optimizer
# --------------------------------------------------------------------------------------
def one_cycle(total_steps: int, max_lr: float, pct_start: float = 0.3, div_factor: float = 25.0,
              final_div_factor: float = 1e4) -> Callable:
    """torch's OneCycleLR (cos, two phases) as an optax schedule ``count -> lr``.

    Phase ends as torch lays them out: ``pct_start * total - 1`` and ``total - 1``; the
    value is held past the horizon (as ``pimm_fn.schedules.one_cycle`` does).
    """
    import jax.numpy as jnp

    initial = max_lr / div_factor
    minimum = initial / final_div_factor
    end1, end2 = float(pct_start * total_steps) - 1, float(total_steps - 1)

    def anneal(a, b, pct):  # torch's _annealing_cos, in its order of operations
        return b + (a - b) / 2.0 * (jnp.cos(math.pi * pct) + 1)

    def schedule(count):
        s = jnp.clip(count, 0, total_steps - 1).astype(jnp.float32)
        warm = anneal(initial, max_lr, s / end1)
        down = anneal(max_lr, minimum, (s - end1) / (end2 - end1))
        return jnp.where(s <= end1, warm, down)

    return schedule


def make_tx(total_steps: int, max_lr: float, weight_decay: float, clip: float):
    """clip_by_global_norm + AdamW over the one-cycle lr (torch.optim.AdamW's defaults)."""
    import optax

    return optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(one_cycle(total_steps, max_lr), b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay),
    )


# --------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------
def _linear_params(sd, prefix, bias=True):
    p = {"kernel": np.ascontiguousarray(sd[prefix + ".weight"].T)}  # torch [out, in] -> [in, out]
    if bias:
        p["bias"] = sd[prefix + ".bias"]
    return p


def _bn_params(sd, prefix):
    return ({"scale": sd[prefix + ".weight"], "bias": sd[prefix + ".bias"]},
            {"mean": sd[prefix + ".running_mean"], "var": sd[prefix + ".running_var"]})


def _linear(p, x):
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def _batch_norm(p, stats, x, axes, mask=None):
    """Training-mode BatchNorm: normalise by the batch's (masked) mean and biased variance;
    return the running statistics updated as torch does (unbiased variance, momentum 0.1)."""
    import jax
    import jax.numpy as jnp

    if mask is None:
        n = math.prod(x.shape[a] for a in axes)
        mean = x.mean(axes)
        var = jnp.square(x - mean).mean(axes)
    else:  # rows [N, C]; mask [N] (1 = a real point)
        m = mask[:, None]
        n = mask.sum()
        mean = (x * m).sum(0) / n
        var = (jnp.square(x - mean) * m).sum(0) / n
    y = (x - mean) * jax.lax.rsqrt(var + BN_EPS) * p["scale"] + p["bias"]
    mean_s, var_s = jax.lax.stop_gradient(mean), jax.lax.stop_gradient(var)
    new = {"mean": (1 - BN_MOMENTUM) * stats["mean"] + BN_MOMENTUM * mean_s,
           "var": (1 - BN_MOMENTUM) * stats["var"] + BN_MOMENTUM * var_s * n / (n - 1)}
    return y, new


def masked_cross_entropy(logits, target, ignore_index=-1):
    """Mean cross-entropy over rows whose target is not ``ignore_index`` (0 if none is)."""
    import jax
    import jax.numpy as jnp

    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    w = valid.astype(nll.dtype)
    return (nll * w).sum() / jnp.maximum(w.sum(), 1e-12)


# --------------------------------------------------------------------------------------
# models: (params, stats) from a torch module, a forward, and a batch converter
# --------------------------------------------------------------------------------------
def _state_dict(module) -> dict:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()
            if not k.endswith("num_batches_tracked")}


class JaxModel:
    """A JAX mirror of one torch model: initial params/stats, forward, batch conversion."""

    def __init__(self, params, stats, forward, convert, label_key):
        self.params, self.stats = params, stats
        self.forward = forward  # (params, stats, jbatch) -> (logits, new_stats)
        self.convert = convert  # torch batch dict -> dict of numpy arrays (host side)
        self.label_key = label_key


def mlp_model(module) -> JaxModel:
    import jax

    sd = _state_dict(module)
    idx = sorted({int(k.split(".")[1]) for k in sd})
    params = {f"dense{i}": _linear_params(sd, f"net.{j}") for i, j in enumerate(idx)}

    def forward(params, stats, b):
        h = b["x"]
        for i in range(len(idx)):
            h = _linear(params[f"dense{i}"], h)
            if i < len(idx) - 1:
                h = jax.nn.relu(h)
        return h, stats

    def convert(batch):
        return {"x": batch["x"].numpy(), "y": batch["y"].numpy().astype(np.int32)}

    return JaxModel(params, {}, forward, convert, "y")


def cnn_model(module) -> JaxModel:
    import jax

    sd = _state_dict(module)
    convs = []  # (index in body, stride) of every conv
    for i, layer in enumerate(module.body):
        if layer.__class__.__name__ == "Conv2d":
            if layer.padding != (1, 1) or layer.kernel_size != (3, 3) or layer.bias is not None:
                raise ValueError("cnn_model mirrors ImageClassifier's 3x3, padding 1, bias-free convolutions")
            convs.append((i, layer.stride[0]))
    params, stats = {}, {}
    for k, (i, _) in enumerate(convs):
        # OIHW -> HWIO
        params[f"conv{k}"] = {"kernel": np.ascontiguousarray(sd[f"body.{i}.weight"].transpose(2, 3, 1, 0))}
        params[f"bn{k}"], stats[f"bn{k}"] = _bn_params(sd, f"body.{i + 1}")
    params["head"] = _linear_params(sd, "head")

    def forward(params, stats, b):
        x, new = b["image"], {}
        for k, (_, s) in enumerate(convs):
            x = jax.lax.conv_general_dilated(x, params[f"conv{k}"]["kernel"], (s, s), ((1, 1), (1, 1)),
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x, new[f"bn{k}"] = _batch_norm(params[f"bn{k}"], stats[f"bn{k}"], x, (0, 1, 2))
            x = jax.nn.relu(x)
        return _linear(params["head"], x.mean((1, 2))), new

    def convert(batch):
        return {"image": np.ascontiguousarray(batch["image"].numpy().transpose(0, 2, 3, 1)),  # NCHW -> NHWC
                "label": batch["label"].numpy().astype(np.int32)}

    return JaxModel(params, stats, forward, convert, "label")


def _voxel_groups(grid, cloud, stride, n):
    """Group id in [0, n) per point for (cloud, grid // stride): rank among sorted voxel keys."""
    import jax.numpy as jnp

    g = jnp.floor_divide(grid, stride)
    g = g - g.min(0)
    ext = g.max(0) + 1
    key = ((cloud * ext[0] + g[:, 0]) * ext[1] + g[:, 1]) * ext[2] + g[:, 2]
    perm = jnp.argsort(key)
    sk = key[perm]
    starts = jnp.concatenate([jnp.ones((1,), jnp.int32), (sk[1:] != sk[:-1]).astype(jnp.int32)])
    rank = jnp.cumsum(starts) - 1
    return jnp.zeros((n,), jnp.int32).at[perm].set(rank)


def _group_mean(x, group, segments):
    import jax
    import jax.numpy as jnp

    total = jax.ops.segment_sum(x, group, num_segments=segments)
    count = jax.ops.segment_sum(jnp.ones(x.shape[0], x.dtype), group, num_segments=segments)
    return (total / jnp.maximum(count, 1.0)[:, None])[group]


def _group_max(x, group, segments):
    import jax

    return jax.ops.segment_max(x, group, num_segments=segments)[group]


def pointseg_model(module, bucket: int = POINT_BUCKET) -> JaxModel:
    import jax
    import jax.numpy as jnp

    if getattr(module, "class_weights", None) is not None:
        raise ValueError("pointseg_model mirrors PointSegNet without class_weights")
    for name, m in module.named_modules():
        if m.__class__.__name__ in ("LayerNorm", "Identity") or (hasattr(m, "pool") and m.pool.__name__ != "group_max"):
            raise ValueError(f"pointseg_model mirrors norm='batch', pool='max' only ({name})")
    sd = _state_dict(module)
    params, stats = {}, {}

    def dense(key, prefix):
        params[key] = {"linear": _linear_params(sd, prefix + ".0", bias=False)}
        params[key]["bn"], stats[key] = _bn_params(sd, prefix + ".1")

    dense("stem", "stem")
    strides = [st.stride for st in module.stages]
    for i in range(len(strides)):
        dense(f"stage{i}_point", f"stages.{i}.point")
        dense(f"stage{i}_fuse", f"stages.{i}.fuse")
    dense("head0", "head.0")
    params["head1"] = _linear_params(sd, "head.1")
    ignore = module.ignore_index

    def forward(params, stats, b):
        coord, grid, feat, offset = b["coord"], b["grid_coord"], b["feat"], b["offset"]
        n, clouds = coord.shape[0], offset.shape[0]
        idx = jnp.arange(n, dtype=offset.dtype)
        cloud = jnp.searchsorted(offset, idx, side="right")  # padded points: cloud id B
        mask = (idx < offset[-1]).astype(coord.dtype)
        new = {}

        def dense_apply(key, x):
            y = _linear(params[key]["linear"], x)
            y, new[key] = _batch_norm(params[key]["bn"], stats[key], y, (0,), mask)
            return jax.nn.relu(y)

        h = dense_apply("stem", jnp.concatenate([feat, coord - _group_mean(coord, cloud, clouds + 1)], 1))
        skips = [h]
        for i, s in enumerate(strides):
            group = _voxel_groups(grid, cloud, s, n)
            local = coord - _group_mean(coord, group, n)
            h = dense_apply(f"stage{i}_point", jnp.concatenate([h, local], 1))
            h = dense_apply(f"stage{i}_fuse", jnp.concatenate([h, _group_max(h, group, n)], 1))
            skips.append(h)
        h = dense_apply("head0", jnp.concatenate(skips, 1))
        return _linear(params["head1"], h), new

    def convert(batch):
        n = batch["coord"].shape[0]
        pad = -n % bucket

        def padded(t, value=0):
            a = t.numpy()
            return np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=value)

        return {"coord": padded(batch["coord"]), "grid_coord": padded(batch["grid_coord"]).astype(np.int32),
                "feat": padded(batch["feat"]), "offset": batch["offset"].numpy().astype(np.int32),
                "segment": padded(batch["segment"], ignore).astype(np.int32)}

    return JaxModel(params, stats, forward, convert, "segment")


MODEL_BUILDERS = {"MLPClassifier": mlp_model, "ImageClassifier": cnn_model, "PointSegNet": pointseg_model}


def mirror(module) -> JaxModel:
    """The JAX mirror of a pimm_fn model (MLPClassifier, ImageClassifier or PointSegNet)."""
    name = type(module).__name__
    if name not in MODEL_BUILDERS:
        raise ValueError(f"no JAX mirror for {name}; mirrored: {', '.join(MODEL_BUILDERS)}")
    return MODEL_BUILDERS[name](module)


# --------------------------------------------------------------------------------------
# the jitted training step
# --------------------------------------------------------------------------------------
class JaxTrainer:
    """A jitted ``(params, stats, opt_state, batch) -> (..., loss)`` step over a JaxModel.

    ``run(torch_batch)`` converts (once per batch object, cached), steps and waits for the
    result, so a timed call covers the whole step. ``compile_count`` counts traces of the
    step (one per distinct input shape: ``jit`` compiles on each new trace).
    """

    def __init__(self, model: JaxModel, tx, ignore_index: int = -1):
        import jax
        import optax

        self.model, self.tx = model, tx
        self.compile_count = 0
        self.recompile_reasons: list = []
        self._converted: dict = {}
        self._shapes: set = set()
        self.losses: list = []

        def step(params, stats, opt_state, batch):
            self.compile_count += 1  # Python side effect: runs once per trace, i.e. per compile

            def loss_fn(p):
                logits, new_stats = model.forward(p, stats, batch)
                return masked_cross_entropy(logits, batch[model.label_key], ignore_index), new_stats

            (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_stats, opt_state, loss

        self._step = jax.jit(step, donate_argnums=(0, 1, 2))
        self._block = jax.block_until_ready
        self.reset()

    def reset(self):
        """Fresh copies of the initial params/stats and optimizer state (the step donates them)."""
        import jax
        import jax.numpy as jnp

        params = jax.tree_util.tree_map(jnp.array, self.model.params)
        stats = jax.tree_util.tree_map(jnp.array, self.model.stats)
        self.state = (params, stats, self.tx.init(params))
        self.losses = []

    def batch(self, torch_batch) -> tuple:
        """(device arrays, their shapes) of a torch batch; converted once, then cached by identity
        (the torch batch is kept alive with them, so its id cannot be reused)."""
        key = id(torch_batch)
        if key not in self._converted:
            import jax

            jb = jax.device_put(self.model.convert(torch_batch))
            shape = tuple(sorted((k, v.shape) for k, v in jb.items()))
            self._converted[key] = (torch_batch, jb, shape)
        return self._converted[key][1:]

    def run(self, torch_batch, record=False):
        jb, shape = self.batch(torch_batch)
        if shape not in self._shapes:
            if self._shapes:
                self.recompile_reasons.append(f"new input shape {dict(shape)}")
            self._shapes.add(shape)
        params, stats, opt_state, loss = self._step(*self.state, jb)
        # dispatch is asynchronous: wait for every output, so a timed call is the whole step
        self.state = self._block((params, stats, opt_state))
        loss.block_until_ready()
        if record:
            self.losses.append(float(loss))
        return loss

    def precompile(self, torch_batches) -> None:
        """Step once on the first batch of every input shape not seen yet (one compile each),
        so no compile lands in a timed step."""
        for b in torch_batches:
            if self.batch(b)[1] not in self._shapes:
                self.run(b)


def trainer_for(module, *, total_steps, max_lr, weight_decay, clip) -> JaxTrainer:
    """A JaxTrainer mirroring ``module`` with the benchmark's optimizer settings."""
    jm = mirror(module)
    return JaxTrainer(jm, make_tx(total_steps, max_lr, weight_decay, clip),
                      ignore_index=getattr(module, "ignore_index", -1))


def compare_losses(torch_losses, jax_losses, tol: float = FIRST_LOSS_TOL) -> dict:
    """First-loss agreement (|diff| <= tol) plus the later steps' differences, for the record."""
    diffs = [abs(a - b) for a, b in zip(torch_losses, jax_losses)]
    return {"torch": list(torch_losses), "jax": list(jax_losses), "abs_diff": diffs, "tol": tol,
            "first_ok": bool(diffs and diffs[0] <= tol)}
