"""JIT build and load of the C++ (CPU, OpenMP) extension, and the backend report.

Nothing is compiled at import of ``yoso_serve.kernels``: the first call to
:func:`cpu_extension` (or :func:`backend_info`) builds ``csrc/yoso_cpu*.cpp`` with
``torch.utils.cpp_extension.load`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``), which takes a minute or two on a small machine and
is instant afterwards. The outcome, module or reason for not having one, is decided once per
process under a lock, logged once on the ``yoso_serve.kernels`` logger and never raised:
callers fall back to the pure-PyTorch ops, and :func:`backend_info` says so and why.

``YOSO_KERNEL_BACKEND`` picks the policy: ``auto`` (default: build, fall back to torch when
the build fails), ``torch`` (never build: forced pure PyTorch) or ``cpp`` (build, and the
reason says the choice was requested).

Builds of one extension are serialised across processes by an OS file lock (``flock``) in its
build directory, which the kernel drops when its holder dies. Up to torch 2.13 torch's own
``lock`` file is not dropped: a process killed mid-build leaves it behind and every later
``load`` waits on it forever. Holding the OS lock proves no other build of ours is running, so a
``lock`` file found then is stale and is removed (the reason says so). From torch 2.14 that file
is itself an OS lock that stays after every build and never blocks once its holder is gone, so
it is left alone. Waiting for another process's build gives up
after ``YOSO_KERNEL_BUILD_TIMEOUT`` seconds (default 900) with the pure-PyTorch fallback and a
reason that names the limit, instead of hanging.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from . import _loaded

__all__ = ["BACKEND_ENV", "BUILD_TIMEOUT_ENV", "backend_info", "cpu_extension", "find_cuda_toolkit"]

BACKEND_ENV = "YOSO_KERNEL_BACKEND"
BUILD_TIMEOUT_ENV = "YOSO_KERNEL_BUILD_TIMEOUT"
_DEFAULT_BUILD_TIMEOUT = 900.0
_POLICIES = ("auto", "torch", "cpp")
_CSRC = Path(__file__).resolve().parent / "csrc"
# The torch-facing bindings (module, fused ops, the layer's finish, the passes around the dense layers' int8
# and bf16 GEMMs) and the torch-free kernel files: LSH, weighted LSH, SIMD, int8 hashing, exact YOSO-E. The
# headers hold structs, declarations and a few inline helpers: ninja's dependency files rebuild what
# includes a changed one.
_SOURCES = [_CSRC / f"yoso_cpu{part}.cpp"
            for part in ("", "_fused", "_finish", "_quant", "_parts", "_kernels", "_weighted", "_simd", "_simd_i8",
                         "_simd_bf16", "_exact")]
_EXTENSION_NAME = "yoso_serve_cpu"
# -fno-trapping-math: a comparison may be if-converted without its floating-point exception flags (nothing reads them;
# no result changes). With them kept, GCC left the AVX2 clone of the int8 epilogue's GELU scalar.
CPU_CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math"]

logger = logging.getLogger("yoso_serve.kernels")

_lock = threading.Lock()
_resolved = False
_module: ModuleType | None = None
_reason = ""


def _policy() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in _POLICIES:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(_POLICIES)}")
    return value


def _build_timeout() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else _DEFAULT_BUILD_TIMEOUT
    except ValueError:
        raise ValueError(f"{BUILD_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{BUILD_TIMEOUT_ENV}={raw!r} must be > 0 seconds")
    return value


def _torch_lock_is_a_file() -> bool:
    """Whether torch's ``lock`` blocks by merely existing (torch <= 2.13's FileBaton); torch >= 2.14
    holds an OS-level FileLock on that path instead."""
    import torch.utils.cpp_extension as cpp_extension

    return not hasattr(cpp_extension, "FileLock")


@contextmanager
def _exclusive_build(build_dir: Path, timeout: float, torch_lock_is_a_file: bool = True) -> Iterator[bool]:
    """Hold the OS lock on ``build_dir`` (waiting at most ``timeout`` s); yields whether a stale
    torch ``lock`` file was found and removed (only where torch's lock is a mere file)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "yoso_serve.flock", "a") as guard:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process has been building in {build_dir} for longer than "
                                       f"{BUILD_TIMEOUT_ENV}={timeout:g} s") from None
                time.sleep(0.25)
        try:
            stale = build_dir / "lock"
            found = torch_lock_is_a_file and stale.exists()
            if found:
                logger.warning("removing %s: a build lock left by a process that died mid-build", stale)
                stale.unlink(missing_ok=True)
            yield found
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _load(name: str, sources: list[Path], what: str, **flags) -> tuple[ModuleType | None, str]:
    """Build (or take from torch's cache) one extension; (module, reason). Raises only for a bad
    ``YOSO_KERNEL_BUILD_TIMEOUT``."""
    # Imported here, not at module level: cpp_extension pulls in setuptools and probes compilers.
    from torch.utils.cpp_extension import _get_build_directory, load

    timeout = _build_timeout()  # a bad setting raises, like a bad policy
    try:
        build_dir = Path(_get_build_directory(name, False))
        with _exclusive_build(build_dir, timeout, _torch_lock_is_a_file()) as removed_stale:
            module = load(name=name, sources=[str(p) for p in sources], extra_ldflags=["-fopenmp"],
                          build_directory=str(build_dir), verbose=False, **flags)
    except Exception as exc:  # any compiler/linker/import failure means "no extension", with the reason
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"{what} build failed ({type(exc).__name__}: {first_line[:300]})"
    note = " (after removing a stale build lock left by a killed process)" if removed_stale else ""
    return module, f"{what} built and loaded{note}"


def _build() -> tuple[ModuleType | None, str]:
    return _load(_EXTENSION_NAME, _SOURCES, "C++ extension", extra_cflags=CPU_CFLAGS)


def cpu_extension() -> ModuleType | None:
    """The compiled ``yoso_serve_cpu`` module, or None when it is forced off or failed to build.

    Built on the first call (thread-safe, once per process); later calls return the cached
    outcome. Never raises for a build failure (the reason is logged and kept for
    :func:`backend_info`); raises ValueError only for an unknown ``YOSO_KERNEL_BACKEND`` or a bad
    ``YOSO_KERNEL_BUILD_TIMEOUT``.
    """
    global _resolved, _module, _reason
    if _resolved:
        return _module
    with _lock:
        if _resolved:
            return _module
        policy = _policy()
        if policy == "torch":
            module, reason = None, f"{BACKEND_ENV}=torch forces the pure-PyTorch ops"
        else:
            module, reason = _build()
            if policy == "cpp":
                reason = f"{BACKEND_ENV}=cpp requested; {reason}"
        _module, _reason = module, reason
        _loaded.cpu_module = module
        _resolved = True
        backend = "cpp" if module is not None else "torch"
        log = logger.info if module is not None or policy == "torch" else logger.warning
        log("yoso_serve.kernels backend: %s (%s)", backend, reason)
        return _module


def cpu_kernels_built() -> bool:
    """Whether the C++ CPU kernels are in use (built, or taken from the cache; not forced off)."""
    return cpu_extension() is not None


def int8_hashing_body() -> str:
    """Which body hashes in int8 on CPU: "avx512-vnni", "avx2", "portable" (the C++ extension's), or
    "torch" without it (PyTorch's exact fp32 GEMM of the integers)."""
    module = cpu_extension()
    return module.int8_level() if module is not None else "torch"


def exact_bf16_dots() -> bool:
    """Whether exact mode on CPU reads bf16 q and k (the bf16 and int8 dense layers give them) with AVX-512 BF16
    dot products: the C++ extension built, on a CPU that has them, YOSO_CPU_NO_BF16_DOT not set to 1."""
    module = cpu_extension()
    return module is not None and bool(module.bf16_dots())


def backend_info() -> dict:
    """Which attention backend is in use and why (builds the extensions on first call).

    Returns ``{"backend": "cuda"|"cpp"|"torch", "reason": str, "openmp_threads": int,
    "cuda": bool, "cuda_reason": str, "cuda_toolkit": str, "cuda_tables": str}``: "cuda" when torch
    sees a GPU and the CUDA extension built, else "cpp" when the CPU extension built, else "torch".
    ``openmp_threads`` is the thread count the OpenMP kernels (and torch's CPU ops) will use;
    ``cuda_toolkit`` says which CUDA toolkit a CUDA build uses and how it was found, or why
    none was (:func:`find_cuda_toolkit`); ``cuda_tables`` how the CUDA cumulation builds its bucket
    tables ("sorted", the default, or "atomic": :func:`._cuda.table_build`).
    """
    from ._cuda import table_build

    module = cpu_extension()
    cuda_module = cuda_extension()
    threads = module.openmp_max_threads() if module is not None else torch.get_num_threads()
    backend = "cuda" if cuda_module is not None else "cpp" if module is not None else "torch"
    home, how = find_cuda_toolkit()
    return {
        "backend": backend,
        "reason": _cuda_reason if cuda_module is not None else _reason,
        "openmp_threads": int(threads),
        "cuda": cuda_module is not None,
        "cuda_reason": _cuda_reason,
        "cuda_toolkit": f"{home} ({how})" if home is not None else f"none found ({how})",
        "cuda_tables": table_build(),
    }


# ---- CUDA extension: the same binding plus the yoso_cuda*.cu kernels, built with -DWITH_CUDA ----

_CUDA_SOURCES = [*_SOURCES, *(_CSRC / name for name in ("yoso_cuda_ops.cpp", "yoso_cuda.cu", "yoso_cuda_weighted.cu",
                                                       "yoso_cuda_hash.cu"))]
_CUDA_EXTENSION_NAME = "yoso_serve_cuda"
# The Docker image's targets: A100 (8.0), A10/RTX 30xx (8.6), L4/L40 (8.9), H100/H200 (9.0).
DOCKER_CUDA_ARCHS = "8.0;8.6;8.9;9.0"

_cuda_lock = threading.Lock()
_cuda_resolved = False
_cuda_module: ModuleType | None = None
_cuda_reason = ""


_TOOLKIT_ENVS = ("CUDA_HOME", "CUDA_PATH")
_DEFAULT_TOOLKIT = Path("/usr/local/cuda")
# A wrapper script on PATH (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) names the real nvcc.
_WRAPPED_NVCC = re.compile(r"(/[^\s'\"]+)/bin/nvcc\b")


def _is_toolkit(home: Path) -> bool:
    """A CUDA toolkit root: nvcc and the runtime headers, what the build compiles against."""
    return (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime.h").is_file()


def _toolkits_behind_nvcc(nvcc: Path) -> list[tuple[Path, str]]:
    """Toolkit roots an nvcc on PATH points to: its real path's grandparent, then (for a small
    wrapper script) the nvcc paths the script names."""
    real = nvcc.resolve()
    found = [(real.parent.parent, f"nvcc on PATH: {nvcc}" + (f" -> {real}" if real != nvcc else ""))]
    try:
        if real.stat().st_size < 4096:
            text = real.read_text(errors="replace")
            if text.startswith("#!"):
                found += [(Path(m), f"nvcc on PATH: {nvcc} wraps {m}/bin/nvcc") for m in _WRAPPED_NVCC.findall(text)]
    except OSError:
        pass
    return found


def _cuda_version_key(home: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", home.name))


def find_cuda_toolkit(
    env: dict | None = None, which=shutil.which, default: Path = _DEFAULT_TOOLKIT
) -> tuple[Path | None, str]:
    """(toolkit root, how it was found), or (None, what was tried).

    Order: ``$CUDA_HOME`` / ``$CUDA_PATH``, ``/usr/local/cuda``, the nvcc on PATH (its real
    path, or the nvcc a wrapper script execs), then the newest ``/usr/local/cuda-*``. A
    candidate counts only with ``bin/nvcc`` and ``include/cuda_runtime.h``: torch's own guess
    takes the grandparent of whatever nvcc is on PATH, which for a wrapper in /usr/local/bin
    is /usr/local, and the CUDA build then fails.
    """
    env = os.environ if env is None else env
    candidates = [(Path(env[name]), f"${name}") for name in _TOOLKIT_ENVS if env.get(name)]
    candidates.append((default, str(default)))
    nvcc = which("nvcc")
    if nvcc:
        candidates += _toolkits_behind_nvcc(Path(nvcc))
    versions = sorted(default.parent.glob(default.name + "-*"), key=_cuda_version_key, reverse=True)
    candidates += [(home, f"newest {default}-*") for home in versions]
    rejected = []
    for home, how in candidates:
        if _is_toolkit(home):
            skipped = f"; skipped {', '.join(rejected)}: not a toolkit" if rejected else ""
            return home, how + skipped
        rejected.append(str(home) if how == str(home) else f"{home} ({how})")
    missing = "none has bin/nvcc and include/cuda_runtime.h"
    return None, f"tried {', '.join(rejected)}: {missing}; set CUDA_HOME to the toolkit root"


def _use_cuda_toolkit() -> str | None:
    """Point torch's extension builder at :func:`find_cuda_toolkit`'s toolkit; None when there is
    none, else a note for the reason. torch reads its module-level CUDA_HOME at build time."""
    import torch.utils.cpp_extension as cpp_extension

    home, how = find_cuda_toolkit()
    if home is None:
        return None
    cpp_extension.CUDA_HOME = str(home)
    os.environ["CUDA_HOME"] = str(home)  # nvcc and the linker run in subprocesses
    return f"toolkit {home} ({how})"


def _build_cuda() -> tuple[ModuleType | None, str]:
    toolkit = _use_cuda_toolkit()
    if toolkit is None:
        return None, f"CUDA extension not built: no CUDA toolkit found ({find_cuda_toolkit()[1]})"
    module, reason = _load(_CUDA_EXTENSION_NAME, _CUDA_SOURCES, "CUDA extension",
                           extra_cflags=[*CPU_CFLAGS, "-DWITH_CUDA"], extra_cuda_cflags=["-O3", "-std=c++17"])
    return module, f"{reason}; {toolkit}"


def cuda_extension() -> ModuleType | None:
    """The compiled ``yoso_serve_cuda`` module (the CPU ops plus the ``*_cuda`` ops), or None.

    None when torch sees no GPU, when ``YOSO_KERNEL_BACKEND=torch``, or when the build failed
    (the reason is logged once and kept for :func:`backend_info`). Built on the first call
    (thread-safe, once per process; a minute or two with nvcc), cached by torch afterwards.
    """
    global _cuda_resolved, _cuda_module, _cuda_reason
    if _cuda_resolved:
        return _cuda_module
    with _cuda_lock:
        if _cuda_resolved:
            return _cuda_module
        if _policy() == "torch":
            module, reason = None, f"{BACKEND_ENV}=torch forces the pure-PyTorch ops"
        elif not torch.cuda.is_available():
            module, reason = None, "torch sees no CUDA device"
        else:
            module, reason = _build_cuda()
        _cuda_module, _cuda_reason = module, reason
        _cuda_resolved = True
        failed = module is None and torch.cuda.is_available() and _policy() != "torch"
        (logger.warning if failed else logger.info)("yoso_serve.kernels CUDA kernels: %s", reason)
        return _cuda_module


def precompile() -> int:
    """Build every extension this machine can build into torch's extension cache; 0 if all built.

    For the Docker image build, where no GPU is needed: the CUDA extension is built when torch
    is a CUDA build and :func:`find_cuda_toolkit` finds a toolkit, for
    ``TORCH_CUDA_ARCH_LIST`` (default ``DOCKER_CUDA_ARCHS``). Keep the same ``TORCH_CUDA_ARCH_LIST`` and ``TORCH_EXTENSIONS_DIR``
    in the running container, or the first call rebuilds for the local GPU.
    """
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DOCKER_CUDA_ARCHS)
    results = [("cpu", *_build())]
    home, how = find_cuda_toolkit()
    if torch.version.cuda is not None and home is not None:
        results.append(("cuda", *_build_cuda()))
    else:
        print(f"cuda: skipped (torch {torch.__version__} is a CPU build, or no CUDA toolkit: {how})")
    for name, module, reason in results:
        print(f"{name}: {reason}")
    return 0 if all(module is not None for _, module, _ in results) else 1


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the yoso_serve kernel extensions ahead of time.")
    parser.add_argument("--precompile", action="store_true", help="build into TORCH_EXTENSIONS_DIR, then exit")
    if parser.parse_args().precompile:
        raise SystemExit(precompile())
    parser.print_help()
