"""``python -m pimm_fn`` is the ``pimm-fn`` command."""
import sys

from .cli import main

sys.exit(main())
