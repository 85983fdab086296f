"""What one call of the device tool carries to the GPU machine, against its 64 MiB limit.

The tool copies the working tree (tracked files, and untracked ones git does not ignore) plus the
ignored paths the call names in ``carry``, 64 MiB in all. The tree is ~50 MiB (the bundled model is
most of it), so one carried folder fits, never two: the training kit (.kit) and the service's wheels
(.whl) go in different calls (docs/cuda.md, the plan).

    python3 bench/travel.py [--root DIR] [--carry PATH ...]   # the sizes; exit 1 above the limit

Standard library only, so ``bench/gpu_train.sh --kit`` and ``gpu_run.sh --fetch-wheels`` run it with any
python3 (tests/kernels/test_gpu_plan.py checks the plan's calls with it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 2**20


def tree_bytes(root: Path) -> int:
    """Bytes of the files the tool copies from the checkout at root: tracked, and untracked not ignored."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout
    names = {name for name in listed.decode().split("\0") if name}
    return sum(path_bytes(root / name) for name in names)


def path_bytes(path: Path) -> int:
    """Bytes of the regular files at path (a file, or a folder walked without following links); 0 if absent."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            file = Path(folder) / name
            if file.is_file() and not file.is_symlink():
                total += file.stat().st_size
    return total


def travel(root: Path, carry: list[str]) -> dict[str, int]:
    """{"tree": bytes, each carried path: bytes, "total": bytes} of one call carrying ``carry`` (paths under root)."""
    sizes = {"tree": tree_bytes(root), **{c: path_bytes(root / c) for c in carry}}
    return {**sizes, "total": sum(sizes.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--carry", nargs="*", default=[], help="paths the call carries (relative to --root)")
    args = parser.parse_args(argv)
    sizes = travel(args.root, args.carry)
    for name, size in sizes.items():
        print(f"{name:>8}: {size / 2**20:6.1f} MiB")
    if sizes["total"] > LIMIT:
        print(f"travel.py: {sizes['total'] / 2**20:.1f} MiB would travel, over the device tool's "
              f"{LIMIT // 2**20} MiB", file=sys.stderr)
        return 1
    print(f"   limit: {LIMIT / 2**20:6.1f} MiB ({(LIMIT - sizes['total']) / 2**20:.1f} MiB to spare)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
