"""The layers, checked by a tool: import-linter's contracts in pyproject.toml (service → model → kernels;
nothing of HTTP, settings, metrics or Ray below the service; private modules used only inside their own
package; no import circles among a package's modules; the yoso-train commands independent of each
other), and no module-level import circle anywhere in
``yoso_serve``, lazy imports inside functions included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "model", "service")


def _source_tree(tmp_path: Path) -> Path:
    """``yoso_serve/{kernels,model,service}`` as links to the checkout: the editable install maps these
    folders with an import hook, which static analysis cannot follow."""
    top = tmp_path / "src" / "yoso_serve"
    top.mkdir(parents=True)
    for name in PACKAGES:
        (top / name).symlink_to(ROOT / name, target_is_directory=True)
    return top.parent


def test_import_linter_contracts_are_kept(tmp_path):
    src = _source_tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONSAFEPATH": "1"}
    out = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), str(ROOT / "pyproject.toml")],
                         capture_output=True, text=True, cwd=src, env=env, timeout=300)
    assert out.returncode == 0 and "0 broken" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
    assert out.stdout.count(" KEPT") == 5  # every contract in pyproject.toml ran


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_round_a_circle(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_source_tree(tmp_path)))
    graph = grimp.build_graph("yoso_serve")
    assert len(graph.modules) > 50  # the tree was really read
    assert _cycles(graph) == []


def _package_files() -> list[Path]:
    return sorted(p for name in PACKAGES for p in (ROOT / name).rglob("*.py"))


def test_no_file_of_the_installed_package_is_over_400_lines():
    kernel_sources = [p for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in {".cpp", ".h", ".cu", ".cuh"}]
    assert len(kernel_sources) > 10  # the C++ and CUDA sources were really read
    long = {str(p.relative_to(ROOT)): n for p in [*_package_files(), *kernel_sources]
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


def test_nothing_installed_reaches_the_recipes():
    recipe_modules = {p.stem for p in (ROOT / "recipes").rglob("*.py")}
    for path in _package_files():
        text = path.read_text(encoding="utf-8")
        assert "recipes" not in text.replace("recipes/yoso-minilm-l6-4096/corpus.py", ""), path
        for line in text.splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in recipe_modules - {"__init__"}, (path, line)
    packages = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[tool.setuptools]")[1]
    assert "recipes" not in packages.split("[tool.setuptools.package-data]")[0]
