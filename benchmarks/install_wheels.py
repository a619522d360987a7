"""Installs the carried wheels (`.whl/*.whl`) into a target folder (default /tmp/site) for the GPU suite, by one rule:
a carried wheel never replaces a package the image already has.

A wheel is skipped when its distribution is installed in the image (`importlib.metadata`) or when any module it
would install (its `top_level.txt`, else the top-level entries of its RECORD) is already importable
(`importlib.util.find_spec`), both checked with the target folder and the repository taken off `sys.path`. The rest
install with `pip install --no-index --no-deps --target`: nothing the image has is shadowed on `PYTHONPATH`, and no
dependency is fetched or replaced. Why: a carried transformers 5.23 put in front of the image's 5.17 without its
dependencies (it needs a newer huggingface_hub) would break every table; the image's 5.17 runs the suite.

Prints one line per wheel (install / skip and why); exit 1 when pip fails. Standard library only (runs before
anything is installed). `--check` decides and prints, installs nothing.

    python3 benchmarks/install_wheels.py .whl /tmp/site
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheels", help="folder of .whl files")
    p.add_argument("target", nargs="?", default="/tmp/site", help="pip --target folder")
    p.add_argument("--check", action="store_true", help="decide and print only")
    return p.parse_args(argv)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> tuple[str, str]:
    """(distribution, version) from a wheel's file name."""
    dist, version = path.name.split("-")[:2]
    return normalize(dist), version


def top_level_modules(path: Path) -> list[str]:
    """The importable top-level names a wheel installs."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        top = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        if top:
            return sorted({x.strip() for x in z.read(top[0]).decode().splitlines() if x.strip()})
    modules = set()
    for n in names:
        first = n.split("/")[0]
        if first.endswith((".dist-info", ".data")) or first == "__pycache__":
            continue
        if "/" in n:
            modules.add(first)
        elif first.endswith(".py"):
            modules.add(first[:-3])
        elif first.endswith((".so", ".pyd")):
            modules.add(first.split(".")[0])
    return sorted(m for m in modules if m.isidentifier())


def image_has(dist: str, modules: list[str]) -> str | None:
    """Why the image already provides this wheel's package, or None."""
    try:
        found = importlib.metadata.distribution(dist)
        return f"the image has {found.metadata['Name']} {found.version}"
    except importlib.metadata.PackageNotFoundError:
        pass
    for m in modules:
        spec = importlib.util.find_spec(m)
        if spec is not None:
            return f"`{m}` already imports in the image ({spec.origin})"
    return None


def main(argv=None) -> int:
    a = parse_args(argv)
    hidden = {str(Path(a.target).resolve()), str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)}
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) not in hidden]  # the image alone
    importlib.invalidate_caches()
    wheels = sorted(Path(a.wheels).glob("*.whl"))
    chosen = []
    for w in wheels:
        dist, version = wheel_name(w)
        reason = image_has(dist, top_level_modules(w))
        if reason:
            print(f"skip    {w.name}: {reason} (a carried wheel never replaces an image package)")
        else:
            print(f"install {w.name} ({dist} {version}: not in the image)")
            chosen.append(w)
    if a.check or not chosen:
        return 0
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", a.target, *map(str, chosen)]
    done = subprocess.run(pip)
    if done.returncode != 0:
        print(f"pip install failed (exit {done.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
