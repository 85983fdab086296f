"""The CPU image's cold start beside the checkout's: ``docker run`` to /ready 200, and the same server
started from the checkout's venv to /ready 200, in turns, medians of ``--runs``; then ``docker stop`` to
exit 0 (an idle drain), and the image's size.

The image is the one tests/deploy/test_docker_engine.py builds (``yoso-serve:cpu-test``; ``--image`` picks
another). The engine is DOCKER_HOST's, or the default socket's, or else the test's own (its data root,
/var/lib/yoso-serve-test-docker, started here and stopped by its PID at the end). Both servers use the
C++ kernels (the checkout's built into bench/out/torch_extensions) and bind 127.0.0.1 (the container on the host network, so readiness is polled every 50 ms
from here, not through ``docker exec``). One warm-up start of each is not counted. Prints a markdown
table, writes docs/img/image_start.png and, with ``--write-docs``, replaces the "## The CPU image"
section of docs/benchmarks.md.

    PYTHONSAFEPATH=1 .venv/bin/python bench/image.py [--runs 5] [--write-docs]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import cpu_name, save_figure, write_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PLOT = REPO / "docs" / "img" / "image_start.png"
SECTION = "## The CPU image"
TEST_ROOT = Path("/var/lib/yoso-serve-test-docker")


def docker(*args, timeout: float = 120) -> str:
    return subprocess.run(["docker", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          check=True).stdout.strip()


def engine() -> subprocess.Popen | None:
    """None when an engine answers; else the test's dockerd, started (the caller stops it)."""
    if subprocess.run(["docker", "version"], capture_output=True, timeout=20).returncode == 0:
        return None
    os.environ["DOCKER_HOST"] = f"unix://{TEST_ROOT}/docker.sock"
    if subprocess.run(["docker", "version"], capture_output=True, timeout=20).returncode == 0:
        return None
    proc = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none", f"--data-root={TEST_ROOT / 'data'}",
                             f"--exec-root={TEST_ROOT / 'exec'}", f"--pidfile={TEST_ROOT / 'dockerd.pid'}",
                             f"--host={os.environ['DOCKER_HOST']}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "version"], capture_output=True, timeout=20).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("no Docker engine answers and dockerd could not be started (root?)")
        time.sleep(0.2)
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until_ready(port: int, alive) -> float:
    """Seconds spent polling /ready every 50 ms until it answers 200."""
    start = time.perf_counter()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        if not alive():
            raise SystemExit("the server exited before it was ready")
        time.sleep(0.05)


def image_start(image: str) -> tuple[float, float]:
    """(docker run → /ready, docker stop → exited 0), seconds."""
    port = free_port()
    start = time.perf_counter()
    name = docker("run", "-d", "--network=host", "-e", "YOSO_HOST=127.0.0.1", "-e", f"YOSO_PORT={port}", image)
    try:
        until_ready(port, lambda: docker("inspect", "--format", "{{.State.Running}}", name) == "true")
        ready = time.perf_counter() - start
        start = time.perf_counter()
        docker("stop", "-t", "60", name, timeout=90)
        stopped = time.perf_counter() - start
        code = docker("inspect", "--format", "{{.State.ExitCode}}", name)
        if code != "0":
            raise SystemExit(f"the container exited {code} on docker stop")
        return ready, stopped
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def checkout_start() -> tuple[float, float]:
    """(process start → /ready, SIGTERM → exited 0), seconds."""
    port = free_port()
    # an extension folder of its own: other checkouts on this machine rebuilding the shared one would be timed
    env = {**os.environ, "YOSO_KERNEL_BACKEND": "cpp", "PYTHONSAFEPATH": "1",
           "TORCH_EXTENSIONS_DIR": str(REPO / "bench" / "out" / "torch_extensions")}
    start = time.perf_counter()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "yoso-serve"), "--host", "127.0.0.1", "--port",
                             str(port), "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        until_ready(port, lambda: proc.poll() is None)
        ready = time.perf_counter() - start
        start = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        if proc.wait(timeout=60) != 0:
            raise SystemExit(f"the checkout's server exited {proc.returncode} on SIGTERM")
        return ready, time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.kill()


def table(rows: dict[str, list[float]], runs: int) -> str:
    lines = ["| from start to | median (s) | min | max |", "|---|---:|---:|---:|"]
    for what, times in rows.items():
        lines.append(f"| {what} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |")
    return "\n".join(lines) + f"\n\n{runs} runs each, in turns, after one warm-up start of each."


def plot(rows: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    names = list(rows)
    ax.barh(range(len(names)), [statistics.median(rows[n]) for n in names], color="#8cb4d8")
    for i, n in enumerate(names):
        ax.plot(rows[n], [i] * len(rows[n]), "k.", alpha=0.6)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (bar: median; dots: runs)")
    ax.set_title("yoso-serve CPU image: cold start and stop, beside the checkout")
    save_figure(fig, PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="yoso-serve:cpu-test")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if shutil.which("docker") is None:
        raise SystemExit("no docker CLI on PATH: bash deploy/install-system-deps.sh")
    started = engine()
    try:
        if subprocess.run(["docker", "image", "inspect", args.image], capture_output=True).returncode != 0:
            raise SystemExit(f"no image {args.image}: PYTHONSAFEPATH=1 .venv/bin/python -m pytest "
                             "tests/deploy/test_docker_engine.py builds it")
        size = int(docker("image", "inspect", "--format", "{{.Size}}", args.image))
        server = docker("version", "--format", "{{.Server.Version}}")
        driver = docker("info", "--format", "{{.Driver}}")
        image_start(args.image), checkout_start()  # warm-ups: page cache, the checkout's kernel build
        pairs = [("docker run → /ready 200", "docker stop → exit 0 (idle drain)", lambda: image_start(args.image)),
                 ("checkout's yoso-serve → /ready 200", "checkout's SIGTERM → exit 0", checkout_start)]
        rows: dict[str, list[float]] = {k: [] for ready, stop, _ in pairs for k in (ready, stop)}
        loads = []
        for _ in range(args.runs):
            for ready_key, stop_key, measure in pairs:
                ready, stopped = measure()
                rows[ready_key].append(ready)
                rows[stop_key].append(stopped)
                loads.append(os.getloadavg()[0])
    finally:
        if started is not None:
            started.send_signal(signal.SIGTERM)
            started.wait(timeout=60)
    body = (f"`{args.image}` (the CPU flavor, debian:bookworm-slim base): **{size / 1e6:.0f} MB** "
            f"(`docker image inspect`, uncompressed). Docker {server} ({driver} storage); {cpu_name()}, "
            f"{os.cpu_count()} cores; 1-minute load average {min(loads):.1f}–{max(loads):.1f} during the run"
            f"{' (other jobs shared the cores: the times are inflated and spread)' if max(loads) > 1.5 else ''}; "
            f"{datetime.date.today().isoformat()}. `bench/image.py --runs {args.runs}`.\n\n"
            f"{table(rows, args.runs)}\n\n![cold start](img/image_start.png)")
    print(body)
    plot(rows)
    if args.write_docs:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
