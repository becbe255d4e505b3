"""Fetch the small real data sets from the package registry into the data cache.

    python -m pimm_fn.data.fetch lidar|frog|digits|all

Each data set is a file inside a published package (nothing is committed here):
  lidar   tests/data/file_with_both_wkt_and_geotiff_vlrs.las of laspy's sdist
  frog    pyvista/examples/frog_tissues.vti of pyvista's wheel
  digits  sklearn/datasets/data/digits.csv.gz of scikit-learn's wheel
The cache is ``$PIMM_FN_DATA`` or ``~/.cache/pimm_fn``.

A package, not a module: the package ``pimm_fn.data`` imports these functions, so the
command line lives in ``__main__.py``, which nothing imports. (Run as ``-m`` a module
that its package has already imported, runpy warns that it is in sys.modules.)
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

from ...atomic import atomic_write

# name -> (requirement, extra pip args, member suffix inside the archive, cached file name)
SOURCES = {
    "lidar": ("laspy=={laspy}", ["--no-binary", ":all:"],
              "tests/data/file_with_both_wkt_and_geotiff_vlrs.las", "file_with_both_wkt_and_geotiff_vlrs.las"),
    "frog": ("pyvista==0.49.2", [], "pyvista/examples/frog_tissues.vti", "frog_tissues.vti"),
    "digits": ("scikit-learn==1.9.1", ["--only-binary", ":all:"],
               "sklearn/datasets/data/digits.csv.gz", "digits.csv.gz"),
}


def data_root(root: Optional[os.PathLike] = None) -> Path:
    """The data cache directory: ``root``, else $PIMM_FN_DATA, else ~/.cache/pimm_fn."""
    if root is not None:
        return Path(root)
    return Path(os.environ.get("PIMM_FN_DATA") or Path.home() / ".cache" / "pimm_fn")


def fetch_command(name: str) -> str:
    """The shell command that fetches data set ``name``."""
    return f"{sys.executable} -m pimm_fn.data.fetch {name}"


def cached_path(name: str, root: Optional[os.PathLike] = None) -> Path:
    if name not in SOURCES:
        raise KeyError(f"unknown data set {name!r}; known: {sorted(SOURCES)}")
    return data_root(root) / name / SOURCES[name][3]


class DatasetMissingError(FileNotFoundError):
    """A fetched data set is not in the cache; the message holds the fetch command."""


def require(name: str, root: Optional[os.PathLike] = None) -> Path:
    """The cached file of ``name``, or DatasetMissingError with the command to fetch it."""
    path = cached_path(name, root)
    if not path.is_file():
        env = f"PIMM_FN_DATA={data_root(root)} " if root is not None else ""
        raise DatasetMissingError(
            f"data set {name!r} not found at {path}; fetch it with: {env}{fetch_command(name)}"
        )
    return path


def _laspy_version() -> str:
    try:
        from importlib.metadata import version

        return version("laspy")
    except Exception:
        return "2.7.0"


def fetch(name: str, root: Optional[os.PathLike] = None, force: bool = False) -> Path:
    """Download the package holding ``name`` with pip and extract its one file to the cache."""
    target = cached_path(name, root)
    if target.is_file() and not force:
        return target
    requirement, extra, member, _ = SOURCES[name]
    requirement = requirement.format(laspy=_laspy_version())
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"pimm_fn_fetch_{name}_") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, *extra, requirement]
        if "--no-binary" in extra and importlib.util.find_spec("hatchling") is not None:
            # building sdist metadata in an isolated env installs hatchling first (~1 min cold)
            cmd.insert(4, "--no-build-isolation")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        archives = [p for p in Path(tmp).iterdir() if p.is_file()]
        if not archives:
            raise RuntimeError(f"pip download of {requirement} produced no file")
        # atomic: a killed fetch never leaves a truncated file
        atomic_write(target, lambda out: _extract(archives[0], member, out))
    return target


def _extract(archive: Path, member: str, out) -> None:
    """Copy ``member`` of a wheel / zip / tar archive into the open binary file ``out``."""
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(member)]
            if not names:
                raise RuntimeError(f"{member} not in {archive.name}")
            with z.open(names[0]) as src:
                shutil.copyfileobj(src, out)
    else:
        with tarfile.open(archive) as tar:
            names = [m for m in tar.getmembers() if m.name.endswith(member) and m.isfile()]
            if not names:
                raise RuntimeError(f"{member} not in {archive.name}")
            src = tar.extractfile(names[0])
            with src:
                shutil.copyfileobj(src, out)
