"""The CPU image built and run on a real Docker engine: the Dockerfile's CPU flavor on a Debian base made
here with debootstrap, built with this machine's package sources, run with no network at all.

The engine is the one running (DOCKER_HOST or the default socket), or a dockerd started here on a data
root under /var/lib that outlives the run, so the base image and the build cache serve the next run;
it is stopped by its PID afterwards. Skipped, with the reason, only where no engine can be started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from yoso_docker import Docker, PackageSources, buildkit_cli, debian_base

ROOT = Path("/var/lib/yoso-serve-test-docker")
IMAGE = "yoso-serve:cpu-test"
UID = 10001
# Cold (no cache) the build takes minutes on two cores, warm seconds; the whole module's budget.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def docker():
    cli = buildkit_cli()
    if cli is None:
        pytest.skip("no docker CLI that builds with BuildKit (buildx plugin, or docker.io 20.10): "
                    "bash deploy/install-system-deps.sh installs docker.io")
    running = Docker(cli, os.environ.get("DOCKER_HOST"))
    if running.up():
        yield running
        return
    ours = Docker(cli, f"unix://{ROOT}/docker.sock")
    if ours.up():  # another session's engine on the same data root
        yield ours
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.skip("no Docker engine is running and none can be started here (dockerd needs root and "
                    "`bash deploy/install-system-deps.sh`)")
    ROOT.mkdir(parents=True, exist_ok=True)
    # No --storage-driver: dockerd takes overlay2 where the kernel allows it and falls back (vfs).
    with open(ROOT / "dockerd.log", "ab") as log:
        proc = subprocess.Popen([dockerd, "--iptables=false", "--bridge=none", f"--data-root={ROOT / 'data'}",
                                 f"--exec-root={ROOT / 'exec'}", f"--pidfile={ROOT / 'dockerd.pid'}",
                                 f"--host=unix://{ROOT}/docker.sock"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ours.up():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (ROOT / "dockerd.log").read_text(errors="replace")[-1500:]
                pytest.skip(f"dockerd could not be started here (exit {proc.poll()}):\n{tail}")
            time.sleep(0.2)
        ours.owned = True
        yield ours
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def base_tag() -> str:
    """The CPU flavor's base, as the Dockerfile names it (ARG DEBIAN_VERSION)."""
    text = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    return "debian:" + re.search(r"^ARG DEBIAN_VERSION=(\S+)", text, re.M)[1]


@pytest.fixture(scope="module")
def image(kit, docker, tmp_path_factory, pytestconfig):
    """The CPU image, built from the checkout; prints what it took and how big it is."""
    base = debian_base(docker, base_tag(), ROOT / "rootfs")
    work = tmp_path_factory.mktemp("docker-build")
    # torch as this checkout's venv has it: a CPU wheel came from the machine's own sources (no extra index),
    # else the build asks PyTorch's CPU index (install.sh's "auto").
    torch_index = "" if torch.version.cuda is None else "auto"
    began = time.monotonic()
    with PackageSources(work / "pip.conf") as sources:
        built = docker("build", "--network=host", "--progress=plain", *sources.secrets(),
                       "--build-arg=FLAVOR=cpu", f"--build-arg=TORCH_INDEX_URL={torch_index}", "-t", IMAGE,
                       kit.REPO, timeout=2000, check=False)
    took = time.monotonic() - began
    (work / "build.log").write_text(built.stderr)
    assert built.returncode == 0, built.stderr[-5000:]
    steps = set(re.findall(r"^#(\d+) \[(?:builder|runtime) ", built.stderr, re.M))
    cached = steps & set(re.findall(r"^#(\d+) CACHED", built.stderr, re.M))
    if docker.owned and cached != steps:
        # Our engine's disk keeps one build: the image this one replaced goes, and so does build cache that
        # this build did not touch (it touched every layer it stands on and the ones it ran). The cache
        # mounts stay (pip's downloads, ccache), and so does everything after a fully cached build, which
        # touches only the final layers.
        docker("image", "prune", "-f", timeout=600)
        for kind in ("regular", "source.local"):
            docker("builder", "prune", "-f", "--filter", f"type={kind}", "--filter", f"until={int(took) + 15}s",
                   timeout=600)
    size = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    engine = docker("version", "--format", "{{.Server.Version}}").stdout.strip()
    report(pytestconfig, f"docker image {IMAGE}: {size / 1e6:.0f} MB, built in {took:.0f} s ({len(cached)} of "
           f"{len(steps)} steps cached; base {base}; engine {engine})")
    return {"size": size, "build_s": took}


def report(config: pytest.Config, line: str) -> None:
    """A line the suite's output shows (the image's size and times), written past pytest's capture."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


# The client inside the container (the image has python3, no curl): METHOD PATH, a body on stdin.
CLIENT = """
import json, sys, urllib.error, urllib.request
method, path = sys.argv[1:3]
body = sys.stdin.buffer.read() if method == "POST" else None
req = urllib.request.Request("http://127.0.0.1:8080" + path, data=body, method=method,
                             headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=300) as r:
        status, out = r.status, r.read()
except urllib.error.HTTPError as e:
    status, out = e.code, e.read()
except OSError as e:
    status, out = 0, str(e).encode()
print(json.dumps({"status": status, "body": out.decode()}))
"""


def inside(docker: Docker, name: str, method: str, path: str, body=None, timeout: float = 300):
    """(status, body) of one HTTP call made inside the container; status 0 when nothing answered."""
    done = docker("exec", "-i", name, "python3", "-c", CLIENT, method, path, check=False, timeout=timeout,
                  input="" if body is None else json.dumps(body))
    if done.returncode != 0:
        return 0, done.stderr
    answer = json.loads(done.stdout)
    return answer["status"], answer["body"]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


@pytest.fixture(scope="module")
def container(docker, image, pytestconfig):
    """The image run with no network at all; the health check probed every second."""
    name = f"yoso-serve-test-{os.getpid()}"
    began = time.monotonic()
    docker("run", "-d", "--name", name, "--network=none", "--health-interval=1s", IMAGE, "--drain-timeout", "60")
    try:
        wait_for(lambda: inside(docker, name, "GET", "/ready")[0] == 200
                 or docker("inspect", "--format", "{{.State.Running}}", name).stdout.strip() != "true",
                 600, "the container's /ready")
        running = docker("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true"
        assert running, docker("logs", name, check=False).stderr[-3000:]
        report(pytestconfig, f"docker run to /ready 200: {time.monotonic() - began:.1f} s (--network none)")
        yield name
    finally:
        docker("rm", "-f", name, check=False)


def texts(kit) -> list[str]:
    """A sentence, a passage past the exact-attention cut-off and a document of a few thousand tokens."""
    words = (kit.REPO / "README.md").read_text().split()
    return ["Long documents, one pass.", " ".join(words[:400]), " ".join((words * 3)[:2500])]


@pytest.fixture(scope="module")
def checkout_vectors(kit, tmp_path_factory):
    """The same texts served outside the container: the checkout's yoso-serve on loopback, with the C++
    kernels the image runs (the pure-PyTorch ones agree to a looser cosine)."""
    work = tmp_path_factory.mktemp("checkout-serve")
    port = kit.free_port()
    env = {**os.environ, "YOSO_KERNEL_BACKEND": "cpp", "PYTHONSAFEPATH": "1"}
    with open(work / "yoso-serve.log", "wb") as log:
        proc = subprocess.Popen([kit.tool("yoso-serve"), "--host", "127.0.0.1", "--port", str(port),
                                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        kit.wait_until(lambda: kit.http_get(f"{url}/ready")[0] == 200, 900, "the checkout's yoso-serve", proc)
        request = urllib.request.Request(f"{url}/embed", data=json.dumps({"inputs": texts(kit)}).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as answer:
            return np.array(json.loads(answer.read()))
    finally:
        kit.stop(proc)


def test_the_image_serves_offline_as_uid_10001_the_vectors_of_the_checkout(kit, docker, image, container,
                                                                           checkout_vectors):
    config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", IMAGE).stdout)
    assert config["User"] == f"{UID}:{UID}" and config["Entrypoint"] == ["yoso-serve"]
    assert "/health" in " ".join(config["Healthcheck"]["Test"])
    # No network: the container has loopback and nothing else, and it served from what the image holds.
    assert docker("inspect", "--format", "{{.HostConfig.NetworkMode}}", container).stdout.strip() == "none"
    devices = docker("exec", container, "cat", "/proc/net/dev").stdout.splitlines()[2:]
    assert [d.split(":")[0].strip() for d in devices] == ["lo"]
    # The server is PID 1 (SIGTERM reaches it) and runs as the image's user, real and effective.
    status = dict(l.split(":", 1) for l in docker("exec", container, "cat", "/proc/1/status").stdout.splitlines())
    assert status["Uid"].split() == [str(UID)] * 4 and status["Gid"].split() == [str(UID)] * 4
    assert "yoso-serve" in docker("exec", container, "cat", "/proc/1/cmdline").stdout

    # The kernels compiled at build time load (nothing compiles here: the image has no compiler), and
    # the model is the one baked into the package.
    code, body = inside(docker, container, "GET", "/info")
    assert code == 200, body
    info = json.loads(body)
    assert info["backend"]["backend"] == "cpp" and info["state"] == "ready", info
    shown = docker("logs", container)
    logs = shown.stdout + shown.stderr
    assert "backend: cpp" in logs and "compiler" not in logs, logs[-3000:]

    code, body = inside(docker, container, "POST", "/embed", {"inputs": texts(kit)})
    assert code == 200, body
    served = np.array(json.loads(body))
    assert served.shape == checkout_vectors.shape
    norms = np.linalg.norm(served, axis=1) * np.linalg.norm(checkout_vectors, axis=1)
    cosine = (served * checkout_vectors).sum(1) / norms
    assert cosine.min() >= 0.9999, cosine

    # The image's HEALTHCHECK command itself (probed every second here) passes.
    wait_for(lambda: docker("inspect", "--format", "{{.State.Health.Status}}", container).stdout.strip() == "healthy",
             60, "docker's health status 'healthy'")


# Inside the container: watch /metrics every 10 ms and exit as soon as a work request is in flight.
WATCH_IN_FLIGHT = """
import re, sys, time, urllib.request
print("watching", flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    with urllib.request.urlopen("http://127.0.0.1:8080/metrics", timeout=5) as r:
        if re.search(rb"^yoso_in_flight_requests [1-9]", r.read(), re.M):
            sys.exit(0)
    time.sleep(0.01)
sys.exit(1)
"""


def test_docker_stop_drains_the_request_in_flight_and_exits_0(kit, docker, container, tmp_path):
    """SIGTERM while a long request runs: it is answered in full, then the container exits 0, well inside
    docker stop's grace period."""
    words = (kit.REPO / "README.md").read_text().split() * 4
    documents = [" ".join(words[i * 300: i * 300 + 3000]) for i in range(4)]
    (tmp_path / "request.json").write_text(json.dumps({"inputs": documents}))
    watch = subprocess.Popen([docker.cli, "exec", container, "python3", "-c", WATCH_IN_FLIGHT],
                             stdout=subprocess.PIPE, text=True, env=docker.env)
    assert watch.stdout.readline().strip() == "watching"
    with open(tmp_path / "request.json") as request:
        client = subprocess.Popen([docker.cli, "exec", "-i", container, "python3", "-c", CLIENT, "POST", "/embed"],
                                  stdin=request, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=docker.env)
    assert watch.wait(timeout=150) == 0, "the request was never seen in flight"
    grace = 90  # past the server's --drain-timeout: what cuts the drain short is the server, not docker
    began = time.monotonic()
    docker("stop", "-t", grace, container, timeout=grace + 30)
    stopped = time.monotonic() - began
    state = json.loads(docker("inspect", "--format", "{{json .State}}", container).stdout)
    out, err = client.communicate(timeout=60)
    answer = json.loads(out) if out.strip() else {"status": None, "body": err}
    assert answer["status"] == 200, answer
    assert len(json.loads(answer["body"])) == len(documents)
    assert state["ExitCode"] == 0 and not state["OOMKilled"], state
    assert stopped < 60, f"docker stop took {stopped:.1f} s (grace {grace} s, drain timeout 60 s)"
    # The drain was real: the answer went out after the signal, before the application shut down.
    shown = docker("logs", "--timestamps", container)  # uvicorn's access log is stdout, the rest stderr
    logs = "\n".join(sorted((shown.stdout + shown.stderr).splitlines()))
    signal_at, answer_at = logs.index("Shutting down"), logs.rindex('"POST /embed HTTP/1.1" 200')
    assert signal_at < answer_at < logs.index("Application shutdown complete"), logs[-2000:]
