"""``python -m pimm_fn.data.fetch lidar|frog|digits|all [--root DIR] [--force]``."""
from __future__ import annotations

import argparse

from pimm_fn.data.fetch import SOURCES, fetch
from pimm_fn.data.fetch import __doc__ as _doc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pimm_fn.data.fetch", description=_doc.split("\n")[0])
    parser.add_argument("names", nargs="+", choices=[*SOURCES, "all"])
    parser.add_argument("--root", default=None, help="cache dir (default $PIMM_FN_DATA or ~/.cache/pimm_fn)")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    names = list(SOURCES) if "all" in args.names else args.names
    for name in names:
        print(f"{name}: {fetch(name, args.root, args.force)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
