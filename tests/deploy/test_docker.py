"""The Dockerfile and its build context, checked without a Docker engine: hadolint, the stage
layout the issue asks for, and a build context that holds everything `pip install .` needs."""

from __future__ import annotations

import re
import subprocess

import pytest


@pytest.fixture(scope="module")
def dockerfile(kit) -> str:
    return (kit.REPO / "Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    return [(l.split(None, 1)[0].upper(), l.split(None, 1)[1] if " " in l.strip() else "")
            for l in joined.splitlines() if l.strip()]


def stage(text: str, name: str) -> list[tuple[str, str]]:
    """The instructions of the stage ``FROM ... AS name``."""
    out, current = [], None
    for ins, args in instructions(text):
        if ins == "FROM":
            current = args.split()[-1] if " AS " in args.upper() else None
        elif current == name:
            out.append((ins, args))
    return out


def test_hadolint_clean(kit):
    result = subprocess.run([kit.tool("hadolint"), "--config", str(kit.REPO / ".hadolint.yaml"),
                             str(kit.REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_known_mistake(kit, tmp_path):
    # The oracle is alive: the same config rejects an untagged base, `cd` in RUN and a shell-form ENTRYPOINT.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && echo hi\nENTRYPOINT yoso-serve\n")
    result = subprocess.run([kit.tool("hadolint"), "--config", str(kit.REPO / ".hadolint.yaml"), str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert {"DL3006", "DL3003", "DL3025"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_flavor_argument_picks_cuda_or_plain_bases(dockerfile):
    froms = {args.split()[-1]: args.split()[0] for ins, args in instructions(dockerfile) if ins == "FROM"}
    assert froms["build-gpu"].startswith("nvidia/cuda:${CUDA_VERSION}-devel-")
    assert froms["runtime-gpu"].startswith("nvidia/cuda:${CUDA_VERSION}-runtime-")
    assert not froms["build-cpu"].startswith("nvidia/") and not froms["runtime-cpu"].startswith("nvidia/")
    assert froms["builder"] == "build-${FLAVOR}" and froms["runtime"] == "runtime-${FLAVOR}"
    # Builder and runtime of one flavour share the OS, so the venv copied across finds its python.
    assert froms["build-cpu"] == froms["runtime-cpu"]
    assert froms["build-gpu"].split("-devel-")[1] == froms["runtime-gpu"].split("-runtime-")[1]
    top = dict(a.split("=", 1) for i, a in instructions(dockerfile.split("FROM", 1)[0]) if i == "ARG")
    assert top["FLAVOR"] == "gpu"
    # torch 2.13's PyPI wheels are built with CUDA 13: a 12.x nvcc refuses to build against them.
    assert top["CUDA_VERSION"].startswith("13.")


def test_builder_runs_install_script_for_all_target_archs(kit, dockerfile):
    top = dict(a.split("=", 1) for i, a in instructions(dockerfile.split("FROM", 1)[0]) if i == "ARG")
    assert top["TORCH_CUDA_ARCH_LIST"].strip('"') == "8.0;8.6;8.9;9.0"
    builder, runtime = kit.dockerfile_env("builder"), kit.dockerfile_env("runtime")
    # Same arch list, extension folder, CUDA home and model cache where the kernels are built and
    # where they are loaded: torch's loader rebuilds (and, without nvcc, fails) when flags differ.
    for name in ("TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "CUDA_HOME", "YOSO_CACHE_DIR", "PATH"):
        assert builder[name] == runtime[name], name
    assert builder["TORCH_CUDA_ARCH_LIST"] == "${TORCH_CUDA_ARCH_LIST}"
    assert all(builder[n].startswith("/opt/yoso/") for n in ("TORCH_EXTENSIONS_DIR", "YOSO_CACHE_DIR"))
    steps = [(i, a) for i, a in stage(dockerfile, "builder") if i == "COPY" or "deploy/install.sh" in a]
    # torch alone first, from a COPY of deploy/ only (a code change leaves that layer cached), then the rest
    assert [i for i, _ in steps] == ["COPY", "RUN", "COPY", "RUN"]
    assert steps[0][1] == "deploy/install.sh deploy/requirements.lock.txt /src/deploy/" and steps[2][1] == ". /src"
    assert "--torch-only" in steps[1][1] and "--torch-only" not in steps[3][1]
    # the kernels compile through ccache, whose cache outlives the layer
    assert "--mount=type=cache,target=/root/.cache/ccache" in steps[3][1] and "/usr/lib/ccache:" in steps[3][1]
    # ...named `c++` in the build file, as the runtime (no ccache there) names it, or torch's loader rebuilds
    assert "TORCH_NO_COMPILER_WRAPPER=1" in steps[3][1]
    for _, run in (steps[1], steps[3]):
        assert '"--${FLAVOR}"' in run and "--python /opt/yoso/venv/bin/python" in run
        assert "--mount=type=cache,target=/root/.cache/pip" in run
        # pip sources beyond PyPI arrive as a secret: in no layer, in no cache key
        assert "--mount=type=secret,id=pip.conf,target=/etc/pip.conf" in run and "--mount=type=secret,id=pip-ca" in run
    # no `# syntax=` line: the engine's own frontend, so an offline build pulls nothing but its bases
    assert not dockerfile.lstrip().startswith("# syntax")


def test_runtime_stage_serves_as_non_root_with_healthcheck(kit, dockerfile):
    runtime = stage(dockerfile, "runtime")
    ins = [i for i, _ in runtime]
    assert ins[-1] == "ENTRYPOINT" and runtime[-1][1] == '["yoso-serve"]'
    assert ("EXPOSE", "8080") in runtime
    user = [a for i, a in runtime if i == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert ins.index("USER") < ins.index("ENTRYPOINT")
    health = [a for i, a in runtime if i == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "python3" in health[0]
    env = kit.dockerfile_env("runtime")
    assert (env["YOSO_HOST"], env["YOSO_PORT"]) == ("0.0.0.0", "8080")
    assert env["PATH"] == "/opt/yoso/venv/bin:$PATH"
    copies = [a for i, a in runtime if i == "COPY"]
    assert any(a.endswith("/opt/yoso /opt/yoso") and "--from=builder" in a for a in copies)
    # torch takes a lock file in the extension folder: the serving user must own it.
    ext = env["TORCH_EXTENSIONS_DIR"]
    assert f"--from=builder --chown={user[-1]} {ext} {ext}" in copies
    # No compiler in the runtime image: the kernels were compiled in the builder (and torch's loader is told
    # not to look for one, which it would warn about at every start).
    assert env["TORCH_DONT_CHECK_COMPILER_ABI"] == "1"
    assert not re.search(r"\b(g\+\+|gcc|build-essential|python3-dev)\b", " ".join(a for i, a in runtime if i == "RUN"))


def test_build_context_holds_the_package_and_nothing_heavy(kit, tmp_path):
    ctx = kit.build_context(tmp_path / "ctx")
    for needed in ("pyproject.toml", "README.md", "deploy/install.sh", "kernels/__init__.py",
                   "model/__init__.py", "service/__init__.py"):
        assert (ctx / needed).is_file() or not (kit.REPO / needed).exists(), needed
    sources = [p for p in (kit.REPO / "kernels" / "csrc").rglob("*") if p.is_file()]
    assert sources and all((ctx / p.relative_to(kit.REPO)).is_file() for p in sources)
    for heavy in (".venv", ".git", "tests", "bench"):
        assert not (ctx / heavy).exists(), heavy
    assert not list(ctx.rglob("__pycache__")) and not list(ctx.rglob("*.egg-info"))
