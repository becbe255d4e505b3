"""Operations a compiled step can call that torch does not ship in the form needed.

- :func:`external_op` (``ops.custom``): register an opaque kernel (a C++ extension, a
  pybind library, numpy) as a torch custom op with a fake kernel and autograd, so a step
  around it compiles with ``fullgraph=True``.
- :func:`segment_csr` and friends (``ops.segment``): torch_scatter's CSR segment
  reductions in plain torch, traceable with dynamic sizes.
- ``ops.sparse_conv`` (imported on demand, needs spconv): spconv's submanifold
  convolution as an op, with the parameters in the step's state.

See docs/external_kernels.md.
"""
from .custom import external_op
from .segment import segment_csr, segment_max_csr, segment_min_csr

__all__ = ["external_op", "segment_csr", "segment_max_csr", "segment_min_csr"]
