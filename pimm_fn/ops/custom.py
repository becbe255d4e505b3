"""``external_op``: a kernel dynamo cannot see into, registered so a step still compiles whole.

A C++ extension, a pybind library (spconv) or a numpy call is opaque to
``torch.compile``: dynamo either breaks the graph there or fails under ``fullgraph=True``.
Registered as a ``torch.library.custom_op`` it becomes one node of the graph instead. The
compiler never runs the kernel while tracing; it needs three things from you:

- ``fn``: the real kernel, run eagerly at run time (it may do anything: ``.tolist()``,
  numpy, pybind calls). Its parameters and return value carry type annotations, which
  become the op's schema (``torch.Tensor``, ``int``, ``float``, ``bool``, ``list[int]``,
  ``Optional[torch.Tensor]``, a tuple of tensors for several outputs, ...).
- ``fake``: the same signature, returning empty tensors of the right shapes and dtypes
  (``x.new_empty(...)``). The compiler traces with it; the sizes may be symbolic.
- ``backward`` (optional): ``backward(ctx, *grad_outputs)`` returns one gradient per input
  of ``fn`` (None for the non-differentiable ones). It is traced too, so anything opaque
  it calls (the library's own backward kernel) must itself be an ``external_op``.

The helper adds to ``torch.library`` a check of the name, a clear error for a name taken
by another function, and a default ``setup_context`` that saves the inputs and outputs
for the backward (``ctx.inputs``, ``ctx.output``). See docs/external_kernels.md.
"""
from __future__ import annotations

import inspect
import keyword
import re
from typing import Callable, Iterable, Optional

import torch
from torch.library import CustomOpDef

__all__ = ["external_op"]

# Namespaces of torch's own operators: a user op there could shadow or be shadowed by one.
_RESERVED = frozenset({"aten", "prim", "prims", "torch", "quantized", "_c10d_functional", "c10d", "inductor"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# "namespace::op_name" -> (the registering function's module.qualname, the op's schema)
_REGISTERED: dict = {}


def external_op(name: str, fn: Optional[Callable] = None, *, fake: Callable, backward: Optional[Callable] = None,
                setup_context: Optional[Callable] = None, mutates_args: Iterable[str] = ()):
    """Register ``fn`` as the custom op ``name`` ("namespace::op_name") with a fake kernel
    and, optionally, autograd; return the op (call it like ``fn``).

    fn: the real kernel, annotated (see the module docstring). Usable as a decorator:
        ``@external_op("mylib::kernel", fake=...)``.
    fake: shapes and dtypes of ``fn``'s outputs from its inputs, without computing them.
    backward: ``backward(ctx, *grads) -> gradients`` (one per input of ``fn``, a single
        value when ``fn`` has one input). Without ``setup_context`` the inputs are on
        ``ctx.inputs`` (a tuple in ``fn``'s order) and the output on ``ctx.output``.
    setup_context: ``setup_context(ctx, inputs, output)``, torch's own hook, to save less
        than everything; then ``ctx.inputs`` / ``ctx.output`` are not set.
    mutates_args: names of the tensor arguments ``fn`` writes into, or "unknown" (none by
        default: the compiler may then reorder or drop the call as for a pure function).

    Registering a name again from the same function (a notebook cell run twice, a module
    reloaded) replaces its kernels; from another function it is an error, since op names
    are global to the process.
    """
    namespace, op_name = _split_name(name)
    if not callable(fake):
        raise TypeError(f"external_op({name!r}): fake must be a function returning empty tensors of the "
                        f"outputs' shapes (e.g. lambda x: torch.empty_like(x)), got {type(fake).__name__}")
    if backward is not None and not callable(backward):
        raise TypeError(f"external_op({name!r}): backward must be a function backward(ctx, *grads), "
                        f"got {type(backward).__name__}")
    if setup_context is not None and backward is None:
        raise ValueError(f"external_op({name!r}): setup_context was given without backward; it only "
                         "saves what a backward needs, so pass backward= too (or drop setup_context)")
    if setup_context is not None and not callable(setup_context):
        raise TypeError(f"external_op({name!r}): setup_context must be a function setup_context(ctx, inputs, "
                        f"output), got {type(setup_context).__name__}")
    if isinstance(mutates_args, str) and mutates_args != "unknown":
        raise TypeError(f"external_op({name!r}): mutates_args is a sequence of argument names (or 'unknown'), "
                        f"got the string {mutates_args!r}; write ({mutates_args!r},)")
    mutates_args = mutates_args if mutates_args == "unknown" else tuple(mutates_args)

    def register(kernel: Callable) -> CustomOpDef:
        if not callable(kernel):
            raise TypeError(f"external_op({name!r}): the kernel must be a function, got {type(kernel).__name__}")
        params = inspect.signature(kernel).parameters
        unknown = [] if mutates_args == "unknown" else [a for a in mutates_args if a not in params]
        if unknown:
            raise ValueError(f"external_op({name!r}): mutates_args names {unknown}, which are not parameters "
                             f"of {kernel.__qualname__}{inspect.signature(kernel)}")
        try:
            schema = torch.library.infer_schema(kernel, mutates_args=mutates_args)
        except ValueError as err:
            raise ValueError(f"external_op({name!r}): the op's schema comes from {kernel.__qualname__}'s type "
                             f"annotations: {err}") from None
        origin = f"{kernel.__module__}.{kernel.__qualname__}"
        _check_not_taken(f"{namespace}::{op_name}", origin, schema)
        op = torch.library.custom_op(f"{namespace}::{op_name}", kernel, mutates_args=mutates_args)
        op.register_fake(fake)
        if backward is not None:
            if setup_context is None:
                op.register_autograd(_with_saved_inputs(backward), setup_context=_save_everything)
            else:
                op.register_autograd(backward, setup_context=setup_context)
        _REGISTERED[f"{namespace}::{op_name}"] = (origin, schema)
        return op

    return register if fn is None else register(fn)


def _split_name(name) -> tuple:
    if not isinstance(name, str):
        raise TypeError(f"external_op: the op name is a string 'namespace::op_name', got {type(name).__name__}")
    if name.count("::") != 1:
        raise ValueError(f"external_op: op name {name!r} needs exactly one namespace, as 'namespace::op_name' "
                         f"(e.g. 'mylib::{name.split('::')[-1] or 'kernel'}'); the namespace keeps your ops "
                         "apart from torch's and other libraries'")
    namespace, op_name = name.split("::")
    for part, what in ((namespace, "namespace"), (op_name, "op name")):
        if not _IDENT.match(part) or keyword.iskeyword(part):
            raise ValueError(f"external_op: the {what} {part!r} of {name!r} must be a Python identifier "
                             "(letters, digits, underscores; not starting with a digit)")
    if namespace in _RESERVED:
        raise ValueError(f"external_op: namespace {namespace!r} of {name!r} belongs to torch; use your "
                         f"own, e.g. 'mylib::{op_name}'")
    return namespace, op_name


def _check_not_taken(qualname: str, origin: str, schema: str) -> None:
    namespace, op_name = qualname.split("::")
    previous = _REGISTERED.get(qualname)
    if previous is None:
        if hasattr(getattr(torch.ops, namespace), op_name):
            raise ValueError(f"external_op: {qualname!r} is already an operator in this process (not made by "
                             "external_op); pick another name")
        return
    if previous[0] != origin:
        raise ValueError(f"external_op: {qualname!r} is already registered by {previous[0]}; op names are "
                         f"global to the process: give {origin} another name, or reuse the op the first "
                         "registration returned")
    if previous[1] != schema:
        raise ValueError(f"external_op: {qualname!r} was registered as {previous[1]!r}; its signature cannot "
                         f"change to {schema!r} in a running process: restart it or use a new name")


def _save_everything(ctx, inputs, output) -> None:
    """Default setup_context: save every tensor input and output for the backward.

    Tensors go through ``save_for_backward`` (what autograd and the compiler track); other
    values (ints, lists, None) are kept on ``ctx`` as they are.
    """
    multi = isinstance(output, (tuple, list))
    tensors = []

    def slots(values):
        # (True, index into saved_tensors) for a tensor, (False, the value) for anything else
        out = []
        for value in values:
            if isinstance(value, torch.Tensor):
                out.append((True, len(tensors)))
                tensors.append(value)
            else:
                out.append((False, value))
        return out

    ctx.pimm_saved_slots = (slots(inputs), slots(output if multi else (output,)), multi)
    ctx.save_for_backward(*tensors)


def _with_saved_inputs(backward: Callable) -> Callable:
    """The user's backward, with ``ctx.inputs`` / ``ctx.output`` rebuilt from the saved tensors."""

    def backward_with_inputs(ctx, *grads):
        in_slots, out_slots, multi = ctx.pimm_saved_slots
        saved = ctx.saved_tensors
        ctx.inputs = tuple(saved[v] if is_tensor else v for is_tensor, v in in_slots)
        outputs = tuple(saved[v] if is_tensor else v for is_tensor, v in out_slots)
        ctx.output = outputs if multi else outputs[0]
        return backward(ctx, *grads)

    backward_with_inputs.__name__ = getattr(backward, "__name__", "backward")
    return backward_with_inputs
