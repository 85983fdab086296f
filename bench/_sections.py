"""What the bench scripts share: ``--write-docs`` (replace one ``## `` section of docs/benchmarks.md),
the machine line every table is printed with, and alternated timing."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(heading: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the section under ``heading`` in ``doc``, leaving other sections alone."""
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.strip()}\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + ("" if nxt == -1 else "\n" + text[nxt + 1:])
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it ("AMD EPYC", "Intel(R) Xeon(R) ... @ 2.80GHz"): the
    sessions here run on more than one kind of machine, and a figure is only comparable on the same one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """CPU, cores, torch and its thread count, Python: the line every bench table is printed with."""
    import torch

    return (f"{cpu_name()}, {os.cpu_count()} cores visible, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}, CPU only")


def alternated_medians(calls: dict, repeats: int, sync=None) -> dict:
    """Median seconds of each of ``calls`` (name → no-argument callable): one warm-up call each, then
    ``repeats`` rounds calling them in turn, so that machine-load drift hits all of them alike. ``sync``,
    if given, runs before each clock reading (torch.cuda.synchronize for GPU work)."""
    for call in calls.values():
        call()
    times: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            if sync:
                sync()
            start = time.perf_counter()
            call()
            if sync:
                sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out ``fig`` and write it to ``path``, making its folder."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)


def parse_shapes(specs: list[str]) -> list[tuple[int, int]]:
    """``--shapes`` as given ("16x128") → (batch, tokens) pairs."""
    return [tuple(int(v) for v in s.lower().split("x")) for s in specs]


def report(text: str, plot, path: str) -> None:
    """Print a bench's table, then write its plot to ``path`` by ``plot(Path(path))``, unless ``path`` is ''."""
    print(text)
    if path:
        plot(Path(path))
        print(f"plot: {path}")
