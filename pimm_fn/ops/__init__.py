"""Operations a compiled step can call that torch does not ship in the form needed.

- :func:`external_op` (``ops.custom``): register an opaque kernel (a C++ extension, a
  pybind library, numpy) as a torch custom op with a fake kernel and autograd, so a step
  around it compiles with ``fullgraph=True``.
- :func:`segment_csr` and friends (``ops.segment``): torch_scatter's CSR segment
  reductions in plain torch, traceable with dynamic sizes.
- :func:`neighbour_conv` (``ops.submanifold``): a submanifold convolution over listed
  neighbour pairs (PTv3's positional encoding) as one op, so the compiler does not trace
  its per-offset loop.
- ``ops.sparse_conv`` (imported on demand, needs spconv): spconv's submanifold
  convolution as an op, with the parameters in the step's state.

See docs/external_kernels.md.
"""
from .custom import external_op
from .segment import segment_csr, segment_max_csr, segment_min_csr
from .submanifold import neighbour_conv

__all__ = ["external_op", "neighbour_conv", "segment_csr", "segment_max_csr", "segment_min_csr"]
