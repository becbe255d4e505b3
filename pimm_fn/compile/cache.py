"""A disk cache of compiled steps: a second process loads the step instead of tracing it.

A whole-step ``compile_step`` uses it by default (``cache=None``: the folder named by
``$PIMM_FN_STEP_CACHE``, ``off`` to disable, else ``~/.cache/pimm_fn/steps``); ``cache=True``
or ``cache=DIR`` ask for it explicitly, ``cache=False`` turns it off. The step's first call
is compiled with dynamo's precompile API (``torch.compile(...).aot_compile``), saved under
a key, and a later process with the same key loads it
(``torch.compiler.load_compiled_function``) without running dynamo or AOTAutograd again.
A point batch's unbacked point dims are left out of the key: one artifact serves every
point count. The kernels themselves are the inductor cache's (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_$USER``); without them a load still works and compiles the
kernels again.

The folder is bounded: after each save, the least recently used artifacts (a load
refreshes an artifact's time) are removed until it holds at most
``$PIMM_FN_STEP_CACHE_MAX_MB`` MiB (default 2 GiB), with temp files of dead writers.

The key is what the artifact was specialised on. dynamo's own guards (kept in the
artifact) cover the tensors' shapes, dtypes and devices and the module's structure; they
do not cover values captured by the step's closures (``clip_grad``, a loss weight, the
optimizer's kernel scalars), so the key hashes those too:
:func:`fingerprint` walks the step core and the optimizer through their closures,
defaults and the globals their code names, down to numbers, strings and tensor values,
plus the model's class sources, repr and train/eval flags, pimm_fn's own sources, torch's
version and config, and the CPU. A value the walk cannot read is hashed by its repr, so
an unknown object at worst costs a cache miss, never a stale load. The exception: a
:class:`~pimm_fn.hyper.Hyper` reached through the state's optimizer (the schedules' and
optimizers' numbers) holds tensors the step reads as inputs on every call, so only its
names are in the key: a run with another learning rate or length loads the same step.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pathlib
import re
import types
from typing import Any, Optional

import attrs
import torch

from .. import torch_compat
from ..hyper import Hyper
from ..tree import NAMESPACE, tree_leaves
from ..user_warning import warn
from . import kernel_units

_MAX_DEPTH = 40
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def default_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/pimm_fn/steps`` (default ``~/.cache/pimm_fn/steps``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "pimm_fn" / "steps"


_ENV = "PIMM_FN_STEP_CACHE"
_OFF = ("0", "off", "false", "no", "none")


def _env_folder():
    """``$PIMM_FN_STEP_CACHE``: None when unset, False when it turns the cache off, else the folder."""
    raw = os.environ.get(_ENV, "").strip()
    if not raw:
        return None
    return False if raw.lower() in _OFF else pathlib.Path(raw).expanduser()


def auto_dir() -> Optional[pathlib.Path]:
    """The folder a step uses when compile_step's ``cache`` is left None: ``$PIMM_FN_STEP_CACHE``
    (``off`` disables the cache) or :func:`default_dir`."""
    folder = _env_folder()
    return default_dir() if folder is None else (folder or None)


def asked_by_environment() -> bool:
    """Whether ``$PIMM_FN_STEP_CACHE`` names a folder (a choice, unlike the default folder)."""
    return bool(_env_folder())


def resolve_dir(cache) -> Optional[pathlib.Path]:
    """``cache`` as given to compile_step: None (:func:`auto_dir`), False (off), True (the
    default folder) or a folder."""
    if cache is None:
        return auto_dir()
    if cache is False:
        return None
    if cache is True:
        return default_dir()
    if isinstance(cache, (str, os.PathLike)):
        return pathlib.Path(cache).expanduser()  # as $PIMM_FN_STEP_CACHE is (not a folder named "~")
    raise TypeError(f"compile_step(cache=...) takes True, False/None or a folder path, got {cache!r}")


@functools.cache
def _package_sources() -> str:
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parent.parent  # the pimm_fn package
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


class _Hasher:
    """Feeds a value's meaning (not its identity) into a sha256, following functions' closures."""

    def __init__(self):
        self.h = hashlib.sha256()
        # id -> the object, held so that its id stays its own: a temporary (a dict built to
        # be hashed) freed while hashing could hand its id to a later object, which would
        # then hash as "<seen>" and drop out of the key.
        self._seen: dict = {}
        # True while hashing the state's optimizer: its Hyper tensors are the step's inputs.
        self.hyper_inputs = False

    def text(self, s: str) -> None:
        self.h.update(s.encode("utf-8", "backslashreplace"))
        self.h.update(b"\0")

    def value(self, obj: Any, depth: int = 0) -> None:
        if depth > _MAX_DEPTH:
            self.text(f"<too deep {type(obj).__qualname__}>")
            return
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            self.text(f"{type(obj).__name__}:{obj!r}")
            return
        if isinstance(obj, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
            self.text(repr(obj))
            return
        if id(obj) in self._seen:
            self.text("<seen>")
            return
        self._seen[id(obj)] = obj
        d = depth + 1
        if isinstance(obj, Hyper):
            # In a core's own closure a Hyper's tensors are constants of a saved step (a load
            # with other values returns the saved ones): hashed by value there.
            self.text(f"hyper:{list(obj.values)}" if self.hyper_inputs else f"hyper:{obj!r}")
        elif isinstance(obj, torch.Tensor):
            t = obj.detach()
            self.text(f"tensor:{t.dtype}:{tuple(t.shape)}:{t.device}:{t.requires_grad}")
            if t.device.type != "meta":
                self.h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, (tuple, list)):
            self.text(f"{type(obj).__qualname__}[{len(obj)}]")
            for x in obj:
                self.value(x, d)
        elif isinstance(obj, (set, frozenset)):
            self.text(f"set[{len(obj)}]")
            for x in sorted(obj, key=repr):
                self.value(x, d)
        elif isinstance(obj, dict):
            self.text(f"dict[{len(obj)}]")
            for k in sorted(obj, key=repr):
                self.value(k, d)
                self.value(obj[k], d)
        elif isinstance(obj, types.FunctionType):
            self.function(obj, d)
        elif isinstance(obj, types.MethodType):
            self.value(obj.__func__, d)
            self.value(obj.__self__, d)
        elif isinstance(obj, functools.partial):
            self.text("partial")
            self.value(obj.func, d)
            self.value(obj.args, d)
            self.value(obj.keywords, d)
        elif isinstance(obj, types.ModuleType):
            self.text(f"module:{obj.__name__}")
        elif isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            self.text(f"builtin:{getattr(obj, '__module__', '')}.{obj.__qualname__}")
        elif isinstance(obj, type):
            self.cls(obj, d)
        elif isinstance(obj, torch.nn.Module):
            self.module(obj, d)
        else:
            self.instance(obj, d)

    def code(self, code: types.CodeType, fn_globals: dict, depth: int) -> None:
        self.text(f"code:{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}")
        self.h.update(code.co_code)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                self.code(c, fn_globals, depth + 1)
            else:
                self.value(c, depth + 1)
        # The globals the code reads (a module-level constant or helper changes the step too).
        for name in code.co_names:
            if name in fn_globals:
                self.text(f"global:{name}")
                self.value(fn_globals[name], depth + 1)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        self.text(f"function:{fn.__module__}.{fn.__qualname__}")
        if (fn.__module__ or "").split(".")[0] == "torch":
            return  # torch's version is in the key already; its globals hold per-process state
        self.code(fn.__code__, fn.__globals__, depth)
        self.value(fn.__defaults__, depth)
        self.value(fn.__kwdefaults__, depth)
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                self.text("<empty cell>")
                continue
            self.value(contents, depth)

    def cls(self, cls: type, depth: int) -> None:
        self.text(f"class:{cls.__module__}.{cls.__qualname__}")
        if cls.__module__.split(".")[0] in ("torch", "builtins", "typing", "collections", "abc", "enum"):
            return  # torch's version and the interpreter are in the key already
        for name, member in sorted(vars(cls).items()):
            if name.startswith("__") and name != "__call__":
                continue  # generated plumbing (attrs' __init__/__hash__ carry per-process values)
            if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                fn = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
                if isinstance(fn, types.FunctionType):
                    self.text(f"member:{name}")
                    self.function(fn, depth + 1)
            elif not name.startswith("__"):
                self.text(f"attr:{name}")
                self.value(member, depth + 1)

    def module(self, m: torch.nn.Module, depth: int) -> None:
        # Structure, hyperparameters (repr) and train/eval flags; the weights are state leaves.
        self.text(f"nn:{repr(m)}")
        self.text(repr(sorted((n, s.training) for n, s in m.named_modules())))
        for sub in sorted({type(s) for s in m.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
            for klass in sub.__mro__:
                if klass.__module__.startswith("torch."):
                    break
                self.cls(klass, depth)
        extra = {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
        self.value(extra, depth)

    def instance(self, obj: Any, depth: int) -> None:
        cls = type(obj)
        self.cls(cls, depth)
        fields = getattr(obj, "__dict__", None)
        slots = [s for k in cls.__mro__ for s in getattr(k, "__slots__", ()) if isinstance(s, str)]
        if fields is None and not slots:
            # Unknown: a changed repr is a miss, never a stale hit (addresses left out).
            self.text("repr:" + _ADDRESS.sub("", repr(obj)))
            return
        if fields is not None:
            self.value(dict(fields), depth)
        for s in slots:
            if s not in ("__dict__", "__weakref__") and hasattr(obj, s):
                self.text(f"slot:{s}")
                self.value(getattr(obj, s), depth)


def fingerprint(core, state) -> str:
    """A hex digest that changes whenever something baked into a compiled step changes."""
    from .isa_memo import cpu_features

    h = _Hasher()
    h.text(f"torch:{torch.__version__}")
    h.text(f"pimm_fn:{_package_sources()}")
    h.text(f"cpu:{torch.backends.cpu.get_cpu_capability()}:{cpu_features()}")
    h.text(f"threads:{torch.get_num_threads()}:{torch.get_float32_matmul_precision()}:"
           f"{torch.are_deterministic_algorithms_enabled()}")
    for config in (torch_compat.dynamo_config(), torch_compat.inductor_config()):
        try:
            # Folders are where torch writes, not what it compiles (dynamo's debug folder
            # follows the working directory): the same step from another folder is the same.
            h.value({k: v for k, v in config.save_config_portable().items() if not k.endswith(("_dir", "_dir_root"))})
        except Exception:
            h.text(_ADDRESS.sub("", repr(config)))
    h.value(core)
    h.value(state.model)
    h.hyper_inputs = True
    h.value(state.tx)
    h.value(state.loss_scale is None)
    return h.h.hexdigest()


def leaves_key(inner_state, batch, shapes: bool = True) -> str:
    """Paths, dtypes, devices, and (``shapes``) shapes and strides of the traced inputs;
    the values of other leaves, strings (sample names) excepted.

    Dims marked unbacked (a point batch's point counts) are left out of the shapes: the
    artifact serves every size. A step compiled ``dynamic=True`` leaves shapes out: its
    artifact serves any size its own guards accept, and rejects (falls back to compiling)
    the rest."""
    import optree

    paths, leaves, _ = optree.tree_flatten_with_path((inner_state, batch), namespace=NAMESPACE)
    parts = []
    for p, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            unbacked = torch_compat.unbacked_dims(leaf)  # traced as any size: not part of the key
            shape = tuple(None if d in unbacked else n for d, n in enumerate(leaf.shape))
            size = (shape, tuple(leaf.stride())) if shapes else leaf.dim()
            parts.append((str(p), size, str(leaf.dtype), str(leaf.device), leaf.requires_grad))
        elif isinstance(leaf, str):
            # A batch's sample names: a step that read one would guard on it (and recompile
            # every batch), so the artifact serves any names; keying on them made every run
            # that starts on other samples (a new seed, a resumed epoch) compile again.
            parts.append((str(p), "str"))
        else:
            parts.append((str(p), type(leaf).__name__, repr(leaf)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def shapes_of(batch):
    """The batch's tree with each tensor replaced by its shape."""
    import optree

    return optree.tree_map(lambda x: tuple(x.shape) if isinstance(x, torch.Tensor) else None, batch,
                           namespace=NAMESPACE, none_is_leaf=True)


def mark_changed_dims(first_shapes, batch) -> None:
    """``maybe_mark_dynamic`` the dims of ``batch``'s tensors whose size differs from
    ``first_shapes`` (same tree): the dims dynamo would make dynamic on a second shape."""
    import optree

    if first_shapes is None:
        return
    try:
        old = optree.tree_leaves(first_shapes, namespace=NAMESPACE, none_is_leaf=True,
                                 is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x))
        new = optree.tree_leaves(batch, namespace=NAMESPACE, none_is_leaf=True)
    except Exception:
        return
    if len(old) != len(new):
        return
    for shape, leaf in zip(old, new):
        if isinstance(leaf, torch.Tensor) and isinstance(shape, tuple) and len(shape) == leaf.dim():
            for d, (a, b) in enumerate(zip(shape, leaf.shape)):
                if a != b:
                    torch_compat.mark_backed(leaf, d)


DEFAULT_MAX_BYTES = 2 << 30
_MAX_BYTES_ENV = "PIMM_FN_STEP_CACHE_MAX_MB"


def max_bytes() -> int:
    """The cache folder's size bound: ``$PIMM_FN_STEP_CACHE_MAX_MB`` MiB, default 2 GiB."""
    raw = os.environ.get(_MAX_BYTES_ENV)
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        return max(0, int(float(raw) * (1 << 20)))
    except ValueError:
        raise ValueError(f"{_MAX_BYTES_ENV}={raw!r} is not a number of MiB; set it to e.g. 2048, "
                         "or unset it for the default (2 GiB)") from None


def prune(directory: pathlib.Path, limit: Optional[int] = None, keep: Optional[pathlib.Path] = None) -> list:
    """Remove least recently used artifacts until the folder holds at most ``limit`` bytes
    (default :func:`max_bytes`), and temp files of writers that are gone. A load touches
    its artifact, so what is used stays; ``keep`` (the artifact just written) is never
    removed. Returns the removed paths."""
    from ..atomic import TMP_RE

    limit = max_bytes() if limit is None else limit
    removed, artifacts = [], []
    for p in directory.glob("*"):
        try:
            st = p.stat()
        except OSError:
            continue  # another process removed it
        tmp = TMP_RE.match(p.name)
        if tmp is not None and not _alive(int(tmp.group("pid"))):
            removed.append(p)
        elif p.suffix == ".pt2step" and p != keep:
            artifacts.append((st.st_mtime, st.st_size, p))
        elif p == keep:
            limit -= st.st_size
    total = sum(size for _, size, _ in artifacts)
    for _, size, p in sorted(artifacts, key=lambda a: a[0]):  # oldest use first
        if total <= limit:
            break
        removed.append(p)
        total -= size
    for p in removed:
        try:
            p.unlink()
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def artifact_path(directory: pathlib.Path, name: str, key: str) -> pathlib.Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40] or "step"
    return directory / f"{safe}-{key[:32]}.pt2step"


def save(compiled, path: pathlib.Path) -> None:
    """Write the artifact atomically: a killed writer leaves no half file under the key."""
    from ..atomic import atomic_replace

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_replace(path, lambda tmp: compiled.save_compiled_function(str(tmp)), durable=False)


def load(path: pathlib.Path, core=None, patches: Optional[dict] = None):
    """The saved step; ``core``'s globals resolve the names the artifact refers to.

    ``patches``: the inductor config the step was compiled under (compile_step's mode and
    options). Loading runs under it too: a load re-derives each kernel's inductor-cache key
    from the current config, so a step compiled with, e.g., ``cpp_cache_precompile_headers``
    off and loaded with it on would miss every kernel and compile them all again.
    """
    f_globals = getattr(core, "__globals__", None)
    kwargs = {} if f_globals is None else {"f_globals": f_globals}
    # Loading builds the kernels missing from inductor's cache, in the units they were compiled in.
    with open(path, "rb") as f, torch_compat.inductor_config().patch(patches or {}), kernel_units.batched():
        fn = torch.compiler.load_compiled_function(f, **kwargs)
    torch_compat.complete_loaded_guards(fn)
    return fn


def is_guard_failure(err: BaseException) -> bool:
    """A loaded artifact called on inputs its guards reject (a new shape or dtype)."""
    return isinstance(err, RuntimeError) and "GuardManager check failed" in str(err)


@attrs.frozen
class Precompiled:
    """What :func:`precompiled_step` found: the step (None: compile as without a cache),
    its artifact's path, whether it was loaded, the example batch's shapes, and the graphs
    dynamo counted for a trace it restarted (not compiles of the step)."""

    fn: object
    path: Optional[pathlib.Path]
    loaded: bool
    first_shapes: object
    discarded: int = 0


def precompiled_step(core, name: str, state, batch, directory: Optional[pathlib.Path], *, dynamic,
                     patches: dict, settings: str, asked: Optional[str] = "argument") -> Precompiled:
    """The step from the cache, or compiled now through dynamo's precompile API and saved there.

    directory: None compiles without the cache (nothing loaded or saved): the precompile
        API compiles without running the step, which a background compile needs.
    asked: who asked for the cache. None: nobody (the default folder), so a step that cannot
        be saved compiles as without a cache, silently. ``"environment"``
        (``$PIMM_FN_STEP_CACHE``): a folder that cannot hold the step warns; a step that
        cannot be cached compiles silently (the setting is for every step). ``"argument"``
        (``compile_step(cache=...)``): both warn.
    """
    inner = state.replace(rng=None, cursor=None)
    first_shapes = shapes_of(batch)
    if directory is not None:
        max_bytes()  # a malformed bound fails here, naming itself, not later as a failed save
    if inspect.ismethod(core) and directory is not None:
        # The precompile API saves a bound method's function, whose signature then asks for
        # `self` on every call (GRPO's core): such a step compiles as without the cache.
        if asked == "argument":
            warn(f"the step's core {core.__qualname__} is a bound method, which the step cache cannot save; "
                 "it compiles as usual, and the next process compiles it again", RuntimeWarning)
        return Precompiled(None, None, False, first_shapes)
    path = None
    if directory is not None:
        key = hashlib.sha256("|".join((
            fingerprint(core, state), leaves_key(inner, batch, shapes=dynamic is not True), settings,
        )).encode()).hexdigest()
        path = artifact_path(directory, name, key)
    if path is not None and path.exists():
        try:
            fn = load(path, core, patches)
            os.utime(path)  # recently used: pruning removes the least recently used first
            return Precompiled(fn, path, True, first_shapes)
        except Exception as err:  # a damaged or foreign file: compile instead
            warn(f"the cached step {path} could not be loaded ({type(err).__name__}: {err}); "
                 "compiling it again and replacing the file", RuntimeWarning)
    # dynamic=None would let dynamo's automatic dynamic shapes follow what this process
    # compiled before (another step over the same core code): the saved artifact would
    # then be static or dynamic by the process's history. It is static (its key holds the
    # shapes) unless the step is dynamic=True or the batch carries mark_dynamic'ed dims; a
    # new shape fails its guards and compiles as without a cache, the changed dims dynamic.
    if dynamic is None and not any(torch_compat.is_marked_dynamic(t) or torch_compat.unbacked_dims(t)
                                   for t in tree_leaves(batch) if isinstance(t, torch.Tensor)):
        dynamic = False
    compiled = torch.compile(core, fullgraph=True, dynamic=dynamic, options=patches or None)
    fn = None
    discarded = 0
    for attempt in range(2):
        graphs = torch_compat.compiled_graph_count()
        try:
            with torch_compat.step_tracing_config(), kernel_units.batched():
                fn = compiled.aot_compile(((inner, batch), {}))
            break
        except torch_compat.tensorify_restart_error():
            # dynamo's own loop restarts here (it has just specialised a float input); the
            # precompile API does not, so restart it once.
            if attempt:
                raise
            discarded = torch_compat.compiled_graph_count() - graphs
        except Exception as err:  # not precompilable: compile as without a cache
            if directory is None:
                raise
            if asked != "argument" or torch_compat.is_data_dependent_error(err):
                # (a model reading a point count: compile_step retries with guarded sizes, and says so)
                return Precompiled(None, None, False, first_shapes, discarded)
            first_line = str(err).splitlines()[0] if str(err) else ""
            warn(f"the step cannot be saved to the cache ({type(err).__name__}: {first_line}); it "
                 "compiles as usual, and the next process compiles it again", RuntimeWarning)
            return Precompiled(None, None, False, first_shapes, discarded)
    if path is None:
        return Precompiled(fn, path, False, first_shapes, discarded)
    try:
        save(fn, path)
    except Exception as err:  # a read-only or full disk: run without saving (naming no artifact)
        if asked:
            warn(f"could not save the compiled step to {directory} ({type(err).__name__}: {err}); "
                 "the next process compiles it again", RuntimeWarning)
        return Precompiled(fn, None, False, first_shapes, discarded)
    try:
        prune(directory, keep=path)
    except OSError as err:  # saved; only the folder's bound could not be kept this time
        if asked:
            warn(f"could not remove old compiled steps from {directory} ({type(err).__name__}: {err})",
                 RuntimeWarning)
    return Precompiled(fn, path, False, first_shapes, discarded)
