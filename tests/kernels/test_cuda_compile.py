"""Compile-only checks of the CUDA sources, so a broken kernel fails CI on machines without a GPU.

Every ``kernels/csrc/*.cu`` is compiled with nvcc for each architecture the Docker image ships
(sm_80, sm_86, sm_89, sm_90) with the defines torch's CUDAExtension uses and warnings as
errors; the launchers are plain CUDA C++ (no torch headers), so this takes seconds per arch.
The binding is syntax-checked with ``-DWITH_CUDA`` against torch's and CUDA's headers, which is
what the JIT build compiles on a GPU machine. nvcc is part of the CI image: its absence fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

import yoso_serve.kernels

CSRC = Path(yoso_serve.kernels.__file__).resolve().parent / "csrc"
ARCHS = ["80", "86", "89", "90"]
# What torch.utils.cpp_extension passes to nvcc, so the CI compile sees the JIT build's code.
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
LAUNCHERS = [
    "yoso_lsh_cumulate",
    "yoso_lsh_weighted_cumulate",
    "yoso_cumulate_workspace_bytes",
    "yoso_weighted_cumulate_workspace_bytes",
    "yoso_hash_pack",
    "yoso_hash_rotate",
    "yoso_cumulate_plan",
    "yoso_weighted_cumulate_plan",
]


def nvcc() -> str:
    found = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(found):
        pytest.fail("nvcc not found (PATH, $CUDA_HOME/bin): CI must compile the CUDA kernels")
    return found


def cuda_include() -> Path:
    candidates = [os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda"]
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_runtime.h").exists():
            return Path(home) / "include"
    pytest.fail("cuda_runtime.h not found under $CUDA_HOME, torch's CUDA_HOME or /usr/local/cuda")


def compile_cu(source: Path, arch: str, out: Path) -> subprocess.CompletedProcess:
    cmd = [
        nvcc(),
        "-c",
        "-std=c++17",
        "-O3",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        *TORCH_NVCC_DEFINES,
        "--Werror",
        "all-warnings",
        "-Xcompiler",
        "-Wall,-Wextra,-Werror",
        f"-I{CSRC}",
        str(source),
        "-o",
        str(out),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def cuda_sources() -> list[Path]:
    sources = sorted(CSRC.glob("*.cu"))
    assert sources, f"no .cu sources under {CSRC}"
    return sources


@pytest.mark.parametrize("arch", ARCHS)
def test_every_cu_compiles_for_arch(arch, tmp_path):
    objects = b""
    for source in cuda_sources():
        obj = tmp_path / f"{source.stem}_sm{arch}.o"
        result = compile_cu(source, arch, obj)
        assert result.returncode == 0, f"nvcc sm_{arch} failed on {source.name}:\n{result.stderr[-4000:]}"
        assert obj.stat().st_size > 20_000  # device code, not an empty translation unit
        objects += obj.read_bytes()
    missing = [name for name in LAUNCHERS if name.encode() not in objects]
    assert not missing, f"launchers of yoso_cuda.h defined in no .cu: {missing}"


def test_a_broken_kernel_fails_the_compile(tmp_path):
    """The harness itself: the same command must reject a kernel with a type error."""
    broken = tmp_path / "broken.cu"
    text = (CSRC / "yoso_cuda.cu").read_text()
    marker = "if (at[u] >= 0) add_row<VEC>(acc, sets + at[u] + d0);"
    assert marker in text
    broken.write_text(text.replace(marker, "if (at[u] >= 0) add_row<VEC>(acc, undeclared_in_kernel + at[u] + d0);"))
    result = compile_cu(broken, "90", tmp_path / "broken.o")
    assert result.returncode != 0
    assert "undeclared_in_kernel" in result.stderr


def check_binding_with_cuda(binding: Path, tmp_path: Path) -> None:
    """Syntax-check a binding source with -DWITH_CUDA against torch's and CUDA's headers."""
    include = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(cuda_include())]
    torch_include = Path(cpp_extension.include_paths()[0])
    if not (torch_include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        # A CPU build of torch lacks this one generated header of its CUDA headers.
        stub = tmp_path / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        include.append(str(tmp_path))
    cmd = [
        os.environ.get("CXX", "c++"),
        "-std=c++17",
        "-fsyntax-only",
        "-fopenmp",
        "-DWITH_CUDA",
        "-DTORCH_EXTENSION_NAME=yoso_serve_cuda",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(arg for path in include for arg in ("-isystem", path)),
        f"-I{CSRC}",
        "-Wall",
        "-Werror",
        str(binding),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{binding.name} with -DWITH_CUDA failed:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("source", ["yoso_cpu.cpp", "yoso_cuda_ops.cpp"])
def test_binding_compiles_with_cuda(tmp_path, source):
    """The binding and its CUDA half as the JIT build on a GPU machine compiles them (CUDAExtension, -DWITH_CUDA)."""
    check_binding_with_cuda(CSRC / source, tmp_path)


def test_binding_dispatches_to_every_launcher():
    """Each launcher of yoso_cuda.h is reachable from Python through the one module: yoso_cuda_ops.cpp calls and
    exports them, yoso_cpu.cpp registers them and hands CUDA tensors of its own ops to them."""
    cuda_ops = (CSRC / "yoso_cuda_ops.cpp").read_text()
    binding = (CSRC / "yoso_cpu.cpp").read_text()
    assert "#ifdef WITH_CUDA" in cuda_ops and "register_cuda_ops(m);" in binding
    for name in ("yoso_lsh_cumulate", "yoso_lsh_weighted_cumulate", "yoso_hash_pack", "yoso_hash_rotate",
                 "yoso_hash_int8"):
        assert f"{name}(" in cuda_ops, f"the binding never calls {name} (see docs/cuda.md, 'Binding')"
    for name in ("lsh_cumulate_cuda", "lsh_weighted_cumulate_cuda", "hash_pack_cuda", "hash_rotate_cuda",
                 "hash_int8_cuda"):
        assert f'm.def("{name}"' in cuda_ops, f"the binding does not export {name}"
    for name in ("lsh_cumulate_cuda", "lsh_weighted_cumulate_cuda", "fast_hash_codes_cuda"):
        assert f"return {name}(" in binding, f"yoso_cpu.cpp never hands CUDA tensors to {name}"

