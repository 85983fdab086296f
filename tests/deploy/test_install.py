"""deploy/install.sh, the Dockerfile's install step, run here on a bare venv (CPU flavour) from
the Docker build context: the failure of any step it takes in the image fails this test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCH_PIN = "2.13.0"


def run_install(script, *args, env=None, timeout=60):
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_refuses_without_a_flavour(kit, tmp_path):
    result = run_install(kit.DEPLOY / "install.sh", str(kit.REPO))
    assert result.returncode == 2 and "--cpu or --gpu" in result.stderr
    result = run_install(kit.DEPLOY / "install.sh", "--cpu", str(tmp_path))
    assert result.returncode == 2 and "no pyproject.toml" in result.stderr


@pytest.mark.slow
def test_cpu_install_on_a_bare_venv(kit, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    ctx = kit.build_context(tmp_path / "ctx")
    env = {
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "YOSO_CACHE_DIR": str(tmp_path / "unused"),
        "PYTHONSAFEPATH": "1",
        # Skips byte-compiling torch & co., the slowest part of an install that the image wants
        # (read-only at run time) and this test does not.
        "PIP_COMPILE": "0",
        # torch comes from this machine's wheel mirror (pip.conf find-links), not the CPU index.
        "TORCH_INDEX_URL": "",
        # The venv's bin/ first, as the image's ENV has it (torch's builds then use its ninja).
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
    }
    # The script inside the build context, as the Dockerfile runs it (/src/deploy/install.sh).
    result = run_install(ctx / "deploy" / "install.sh", "--cpu", "--python", str(python),
                         "--model-cache", str(tmp_path / "cache"), str(ctx), env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    # What the image's runtime would see: the installed package (not a checkout), torch as pinned,
    # the extension loading from TORCH_EXTENSIONS_DIR, the baked model under the image's cache path.
    probe = (
        "import json, torch, yoso_serve.service, yoso_serve.kernels as k\n"
        "from yoso_serve.model import default_model_dir\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'package': yoso_serve.service.__file__, 'backend': k.backend_info(),"
        " 'model': str(default_model_dir())}))\n"
    )
    env = {**os.environ, **env, "YOSO_CACHE_DIR": str(tmp_path / "cache"), "YOSO_KERNEL_BACKEND": "auto"}
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["torch"].split("+")[0] == TORCH_PIN and found["cuda"] is None
    assert found["package"].startswith(str(venv / "lib")), found["package"]
    assert found["backend"]["backend"] == "cpp", found["backend"]
    # The distilled default model ships inside the installed package: nothing to convert or bake.
    assert found["model"].startswith(str(venv / "lib")), found["model"]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (Path(found["model"]) / name).is_file(), name
    assert not (tmp_path / "unused").exists()
    # Nothing exported at build time: the default runtime is torch (--runtime hybrid exports at its start)
    assert not (tmp_path / "cache" / "onnx").exists()
    assert list((tmp_path / "ext").rglob("*.so")), "no compiled extension under TORCH_EXTENSIONS_DIR"

    # The Kubernetes init container's hand-over: a `cp -a` copy loads where no compiler exists (PATH
    # is the venv's bin/ alone, like the runtime image), so nothing was rebuilt.
    subprocess.run(["cp", "-a", str(tmp_path / "ext"), str(tmp_path / "copy")], check=True, timeout=60)
    bare = {"HOME": str(tmp_path), "PATH": str(venv / "bin"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "copy"),
            "YOSO_CACHE_DIR": str(tmp_path / "cache"), "PYTHONSAFEPATH": "1"}
    probe = "import json, yoso_serve.kernels as k; print(json.dumps(k.backend_info()))"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300,
                         env=bare, cwd=tmp_path, check=True)
    copied = json.loads(out.stdout.strip().splitlines()[-1])
    assert copied["backend"] == "cpp", copied
    # The image's ENTRYPOINT exists and parses its settings.
    help_text = subprocess.run([str(venv / "bin" / "yoso-serve"), "--help"], capture_output=True,
                               text=True, timeout=120, env=env, check=True).stdout
    assert "--drain-timeout" in help_text and "--port" in help_text


def _fake_bin(folder: Path, **scripts: str) -> str:
    folder.mkdir()
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return str(folder)


def test_system_deps_are_a_no_op_where_prometheus_is_on_path_and_say_what_to_do_where_they_cannot_install(kit, tmp_path):
    """`make test` runs deploy/install-system-deps.sh first: with every binary on PATH it installs nothing
    (apt-get here would fail the test), without root it stops with one line instead of apt's errors, and
    only a missing Prometheus fails it (without dockerd the engine test skips, saying why)."""
    script = kit.DEPLOY / "install-system-deps.sh"

    def run(folder: str):
        return subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "PATH": folder})

    tools = {"prometheus": "exit 0", "promtool": "exit 0", "dockerd": "exit 0", "debootstrap": "exit 0"}
    done = run(_fake_bin(tmp_path / "present", **tools, **{"apt-get": "exit 9"}))
    assert done.returncode == 0 and done.stderr == ""
    unprivileged = run(_fake_bin(tmp_path / "user", id="echo 1000", **{"apt-get": "exit 9"}))
    assert unprivileged.returncode == 1 and "needs root and apt-get" in unprivileged.stderr
    assert "Prometheus" in unprivileged.stderr
    no_engine = run(_fake_bin(tmp_path / "no-engine", id="echo 1000", prometheus="exit 0", promtool="exit 0",
                              **{"apt-get": "exit 9"}))
    assert no_engine.returncode == 0 and "docker.io debootstrap missing" in no_engine.stderr
    assert "engine test will skip" in no_engine.stderr
    # As root, what is missing (and only that) goes to apt-get in one call.
    apt = _fake_bin(tmp_path / "root", id="echo 0", prometheus="exit 0", promtool="exit 0", dockerd="exit 0",
                    **{"apt-get": f'echo "$@" >> {tmp_path}/apt.log'})
    assert run(apt).returncode == 0
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "update -qq", "install -y -qq --no-install-recommends debootstrap"]
    make = subprocess.run(["make", "-n", "test"], cwd=kit.REPO, capture_output=True, text=True, timeout=30)
    assert "bash deploy/install-system-deps.sh" in make.stdout
