"""call_with_frame_room: a call that straddles a frame-stack chunk's end stops mapping a
chunk per call inside it (CPython 3.11+; pimm_fn/frame_room.py says why)."""
import resource

import pytest

from pimm_fn.frame_room import CHUNKED_FRAME_STACK, call_with_frame_room

CALLS = 200


def _leaf():
    return None


# A leaf frame larger than one _descend frame, so that at some depth it is the leaf, and
# not the next _descend, that no longer fits in the current chunk.
_leaf.__code__ = _leaf.__code__.replace(co_stacksize=_leaf.__code__.co_stacksize + 200)


def _descend(depth):
    if depth:
        return _descend(depth - 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        _leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _worst_faults_per_call():
    # A fresh chunk is fresh pages: each call that maps one takes at least one page fault.
    return max(_descend(depth) for depth in range(400)) / CALLS


chunked_stack_only = pytest.mark.skipif(not CHUNKED_FRAME_STACK,
                                        reason="frames live on a chunked stack from CPython 3.11")


@chunked_stack_only
def test_a_call_straddling_a_chunk_end_maps_no_chunk_inside_the_room():
    assert _worst_faults_per_call() >= 0.9  # the pathology this module exists for
    assert call_with_frame_room(_worst_faults_per_call) <= 0.05


def test_it_is_a_plain_call():
    assert call_with_frame_room(lambda a, b=0, *, c: (a, b, c), 1, c=3) == (1, 0, 3)
    with pytest.raises(KeyError, match="raised"):
        call_with_frame_room(lambda: {}["raised"])
