"""Finding the CUDA toolkit for the CUDA build (kernels._build.find_cuda_toolkit), on fake trees.

torch guesses CUDA_HOME as the grandparent of the nvcc on PATH; where that nvcc is a wrapper
script (/usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc) the guess is /usr/local,
which has no CUDA headers, and the build fails. These tests build small directory trees that
look like toolkits (bin/nvcc + include/cuda_runtime.h) and check which one is chosen and what
the report says; nothing here compiles.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

from yoso_serve.kernels import _build


def toolkit(root: Path) -> Path:
    """A directory that passes for a CUDA toolkit root."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "bin" / "nvcc").write_text("#!/bin/sh\necho nvcc\n")
    (root / "bin" / "nvcc").chmod(0o755)
    (root / "include" / "cuda_runtime.h").write_text("#pragma once\n")
    return root


def wrapper(path: Path, target: Path) -> Path:
    """A shell wrapper like this machine's /usr/local/bin/nvcc."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {target}/bin/nvcc "$@"\n')
    path.chmod(0o755)
    return path


def no_nvcc(_name):
    return None


def test_cuda_home_wins_when_it_is_a_toolkit(tmp_path):
    home = toolkit(tmp_path / "env-cuda")
    toolkit(tmp_path / "usr" / "cuda")
    found, how = _build.find_cuda_toolkit({"CUDA_HOME": str(home)}, no_nvcc, tmp_path / "usr" / "cuda")
    assert (found, how) == (home, "$CUDA_HOME")


def test_a_cuda_home_without_headers_is_skipped_and_named(tmp_path):
    bogus = tmp_path / "local"
    (bogus / "bin").mkdir(parents=True)
    (bogus / "bin" / "nvcc").write_text("")
    default = toolkit(tmp_path / "cuda")
    found, how = _build.find_cuda_toolkit({"CUDA_HOME": str(bogus)}, no_nvcc, default)
    assert found == default
    assert how == f"{default}; skipped {bogus} ($CUDA_HOME): not a toolkit"


def test_a_wrapper_script_on_path_leads_to_the_toolkit_it_execs(tmp_path):
    """The case of this machine: torch's guess (the wrapper's grandparent) is not a toolkit."""
    real = toolkit(tmp_path / "cuda-13.0")
    nvcc = wrapper(tmp_path / "usr-local" / "bin" / "nvcc", real)
    found, how = _build.find_cuda_toolkit({}, lambda name: str(nvcc), tmp_path / "absent" / "cuda")
    assert found == real
    assert how.startswith(f"nvcc on PATH: {nvcc} wraps {real}/bin/nvcc; skipped")
    assert f"{tmp_path / 'usr-local'} (nvcc on PATH: {nvcc})" in how  # torch's guess, rejected


def test_a_symlinked_nvcc_resolves_to_its_real_toolkit(tmp_path):
    real = toolkit(tmp_path / "opt" / "cuda-12.8")
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    os.symlink(real / "bin" / "nvcc", link)
    found, how = _build.find_cuda_toolkit({}, lambda name: str(link), tmp_path / "absent" / "cuda")
    assert found == real
    assert how == f"nvcc on PATH: {link} -> {real / 'bin' / 'nvcc'}; skipped {tmp_path / 'absent' / 'cuda'}: not a toolkit"


def test_the_newest_versioned_toolkit_is_the_last_resort(tmp_path):
    for version in ("cuda-9.2", "cuda-12.4", "cuda-12.10"):
        toolkit(tmp_path / version)
    found, how = _build.find_cuda_toolkit({}, no_nvcc, tmp_path / "cuda")
    assert found == tmp_path / "cuda-12.10"  # numeric order: 12.10 > 12.4 > 9.2
    assert how.startswith(f"newest {tmp_path / 'cuda'}-*")


def test_nothing_found_says_what_was_tried(tmp_path):
    found, how = _build.find_cuda_toolkit({"CUDA_PATH": str(tmp_path / "x")}, no_nvcc, tmp_path / "cuda")
    assert found is None
    assert how == (f"tried {tmp_path / 'x'} ($CUDA_PATH), {tmp_path / 'cuda'}: none has bin/nvcc and "
                   "include/cuda_runtime.h; set CUDA_HOME to the toolkit root")


def test_the_cuda_build_uses_the_toolkit_found(tmp_path, monkeypatch):
    """torch's module-level CUDA_HOME (read when it compiles) is set to the toolkit found."""
    home = toolkit(tmp_path / "cuda-13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local")  # torch's wrong guess
    monkeypatch.setenv("CUDA_HOME", str(home))
    seen = {}

    def fake_load(name, sources, what, **flags):
        seen.update(name=name, cuda_home=cpp_extension.CUDA_HOME, sources=[p.name for p in sources])
        return None, f"{what} build failed (test)"

    monkeypatch.setattr(_build, "_load", fake_load)
    module, reason = _build._build_cuda()
    assert module is None
    assert seen["cuda_home"] == str(home) and seen["name"] == "yoso_serve_cuda"
    assert "yoso_cuda.cu" in seen["sources"]
    assert reason == f"CUDA extension build failed (test); toolkit {home} ($CUDA_HOME)"


def test_no_toolkit_means_no_build_attempt(monkeypatch):
    monkeypatch.setattr(_build, "find_cuda_toolkit", lambda: (None, "tried /nowhere"))
    monkeypatch.setattr(_build, "_load", lambda *a, **k: pytest.fail("built without a toolkit"))
    module, reason = _build._build_cuda()
    assert module is None
    assert reason == "CUDA extension not built: no CUDA toolkit found (tried /nowhere)"


def test_backend_info_names_the_toolkit_of_this_machine():
    found, how = _build.find_cuda_toolkit()
    info = _build.backend_info()["cuda_toolkit"]
    if found is None:
        assert info == f"none found ({how})"
    else:
        assert info == f"{found} ({how})" and (found / "include" / "cuda_runtime.h").is_file()
