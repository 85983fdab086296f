"""The README's "Index a corpus" commands, run as written, on the bundled model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds

ROOT = Path(__file__).resolve().parents[2]


def _section_bash(doc: Path, heading: str) -> str:
    text = doc.read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return block


def test_readme_index_a_corpus_runs_as_written(tmp_path):
    script = _section_bash(ROOT / "README.md", "## Index a corpus")
    # yoso-embed on PATH, and nothing else of the venv: its ninja (another version than the system's) would
    # rebuild the C++ kernels, and the next process with the system's ninja would rebuild them back
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "yoso-embed").symlink_to(Path(sys.executable).parent / "yoso-embed")
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"}
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    table = ds.dataset(work / "index" / "parts").to_table()
    assert sorted(table.column("id").to_pylist()) == ["a", "b"]
    assert len(table.column("vector")[0]) == 384 and len(table.column("piece_vectors")[0]) == 1
    manifest = json.loads((work / "index" / "manifest.json").read_text())
    assert manifest["state"] == "complete" and manifest["settings"]["pieces"] == 128
