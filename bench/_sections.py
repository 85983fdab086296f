"""What the bench scripts share: ``--write-docs`` (replace one ``## `` section of docs/benchmarks.md)
and the machine line every table is printed with."""

from __future__ import annotations

import os
import platform
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
