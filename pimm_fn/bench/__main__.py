"""``python -m pimm_fn.bench``: the ``pimm-fn bench`` command."""
import sys

from .cli import bench_main

sys.exit(bench_main())
