"""The top-level API: the names a script needs, everything else reachable, nothing loaded early."""
import subprocess
import sys

import pimm_fn


def test_all_names_resolve_and_old_names_still_work():
    for name in pimm_fn.__all__:
        assert getattr(pimm_fn, name) is not None
    assert 15 <= len(pimm_fn.__all__) <= 25
    from pimm_fn import Autocast, History, amp, events

    assert (pimm_fn.StepEnd is events.StepEnd and Autocast is amp.Autocast
            and History is sys.modules["pimm_fn.fit"].History)
    assert pimm_fn.steps.with_reference is pimm_fn.steps.grpo.__globals__["with_reference"]
    assert set(pimm_fn.__all__) <= set(dir(pimm_fn))


def test_unknown_name_is_an_attribute_error():
    try:
        _ = pimm_fn.no_such_name
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("expected AttributeError")


def test_import_loads_nothing_heavy():
    code = ("import sys, pimm_fn, pimm_fn.fit; heavy = [m for m in ('torch._dynamo', 'pimm_fn.compile', "
            "'pimm_fn.data', 'pimm_fn.models', 'pimm_fn.checkpoint', 'pimm_fn.callbacks.logging', "
            "'pimm_fn.callbacks.tensorboard') if m in sys.modules]; print(heavy, callable(pimm_fn.fit))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"  # and pimm_fn.fit stays the function after importing its module
