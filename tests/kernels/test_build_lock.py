"""The extension build never hangs: a stale torch build lock is removed, a live builder is waited
for at most YOSO_KERNEL_BUILD_TIMEOUT seconds, then the pure-PyTorch fallback is taken.

A killed process can leave torch's ``lock`` file in the build directory; torch's own loader
then waits on it forever, so a server would sit at "loading" for good.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from yoso_serve.kernels import _build


@pytest.fixture(scope="module")
def built_dir() -> Path:
    """The build directory of the C++ extension in this session's cache, built."""
    if _build.cpu_extension() is None:
        pytest.fail(f"the C++ extension must build in this project: {_build.backend_info()['reason']}")
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_build._EXTENSION_NAME, False))


def test_a_lock_left_by_a_killed_build_is_removed_and_the_extension_loads(built_dir, tmp_path):
    # A copy of the built cache (up to date, so nothing recompiles) with the lock a kill leaves.
    cache = tmp_path / "ext"
    shutil.copytree(built_dir, cache / built_dir.name)
    (cache / built_dir.name / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PYTHONSAFEPATH": "1"}
    env.pop(_build.BUILD_TIMEOUT_ENV, None)
    code = "import json; from yoso_serve.kernels._build import backend_info; print(json.dumps(backend_info()))"
    # A fresh process, as a restarted server would be; before the fix it never returned.
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["backend"] == "cpp", info
    assert "stale build lock" in info["reason"]
    assert not (cache / built_dir.name / "lock").exists()
    assert "died mid-build" in out.stderr  # the warning on the kernels logger names what happened


def test_a_live_build_elsewhere_is_waited_for_at_most_the_timeout(built_dir, tmp_path, monkeypatch):
    cache = tmp_path / "ext"
    build = cache / built_dir.name
    build.mkdir(parents=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    monkeypatch.setenv(_build.BUILD_TIMEOUT_ENV, "0.5")
    # Another process's build holds the OS lock (its own open file description, like a process).
    with open(build / "yoso_serve.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").touch()  # torch's lock of that live build: must not be touched
        module, reason = _build._build()
    assert module is None
    assert "YOSO_KERNEL_BUILD_TIMEOUT=0.5 s" in reason and "another process" in reason, reason
    assert (build / "lock").exists()


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_build_timeout_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv(_build.BUILD_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match="YOSO_KERNEL_BUILD_TIMEOUT"):
        _build._build()



def test_torchs_own_os_lock_file_is_left_alone(tmp_path, monkeypatch, caplog):
    """torch >= 2.14 keeps ``lock`` after every build as an OS-level FileLock: not stale, never
    removed, no warning (else every start would claim a killed build)."""
    import torch.utils.cpp_extension as cpp_extension

    build = tmp_path / "yoso_serve_cpu"
    build.mkdir()
    (build / "lock").touch()
    with caplog.at_level("WARNING", logger="yoso_serve.kernels"):
        with _build._exclusive_build(build, 1.0, torch_lock_is_a_file=False) as removed:
            assert removed is False
    assert (build / "lock").exists() and not caplog.records
    monkeypatch.setattr(cpp_extension, "FileLock", object, raising=False)
    assert _build._torch_lock_is_a_file() is False
    monkeypatch.delattr(cpp_extension, "FileLock")
    assert _build._torch_lock_is_a_file() is True  # torch 2.13's FileBaton: the file is the lock
