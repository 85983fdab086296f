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
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    table = ds.dataset(tmp_path / "index" / "parts").to_table()
    assert sorted(table.column("id").to_pylist()) == ["a", "b"]
    assert len(table.column("vector")[0]) == 384 and len(table.column("piece_vectors")[0]) == 1
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert manifest["state"] == "complete" and manifest["settings"]["pieces"] == 128
