"""The real Prometheus binary scraping a real yoso-serve process on loopback: after one /embed
request the service's metrics are in Prometheus (asked through its own HTTP API), the shipped
alert rules evaluate cleanly on them, and so does every dashboard query."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest
import yaml


@pytest.fixture
def yoso_serve(kit, tmp_path):
    """A yoso-serve process (default model, pure-PyTorch kernels: no compile) on 127.0.0.1."""
    port = kit.free_port()
    env = {**os.environ, "YOSO_KERNEL_BACKEND": "torch", "PYTHONSAFEPATH": "1"}
    with open(tmp_path / "yoso-serve.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([kit.tool("yoso-serve"), "--host", "127.0.0.1", "--port", str(port),
                                 "--drain-timeout", "10", "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        kit.wait_until(lambda: kit.http_get(f"{url}/ready")[0] == 200, 300, "yoso-serve ready", proc)
        yield url, proc
    finally:
        kit.stop(proc)


def post_json(url: str, payload) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


@pytest.mark.slow
def test_prometheus_scrapes_yoso_serve(kit, tmp_path, prometheus, yoso_serve):
    url, proc = yoso_serve
    target = url.removeprefix("http://")
    prom = prometheus([target], rule_files=[kit.DEPLOY / "prometheus" / "rules.yml"])

    status, vectors = post_json(f"{url}/embed", {"inputs": ["first document", "a second, longer document"]})
    assert status == 200 and len(vectors) == 2

    def embed_counted():
        found = kit.prom_query(prom, 'yoso_requests_total{job="yoso-serve", route="/embed", status="200"}')
        return found if found and float(found[0]["value"][1]) >= 1 else None

    (sample,) = kit.wait_until(embed_counted, 60, "yoso_requests_total for /embed in Prometheus")
    assert sample["metric"]["instance"] == target
    assert float(sample["value"][1]) == 1.0
    ready = kit.prom_query(prom, 'yoso_ready{job="yoso-serve"}')
    assert [float(r["value"][1]) for r in ready] == [1.0]
    tokens = kit.prom_query(prom, 'yoso_tokens_processed_total{job="yoso-serve"}')
    assert float(tokens[0]["value"][1]) > 0
    batches = kit.prom_query(prom, 'yoso_batch_size_count{job="yoso-serve"}')
    assert float(batches[0]["value"][1]) >= 1

    # Two more scrapes make rate() defined, then the rule files must have evaluated without errors.
    def rules_evaluated():
        _, body = kit.http_get(f"{prom}/api/v1/rules")
        rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = kit.wait_until(rules_evaluated, 30, "alert rules evaluated")
    assert {r["name"] for r in rules} >= {"YosoHighErrorRatio", "YosoQueueWaitHigh", "YosoReplicaNotReady"}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    # A ready, reachable replica answering 200 trips none of these (queue wait depends on the load
    # of the machine running the test, so its alert is left out).
    states = {r["name"]: r["state"] for r in rules}
    assert {states[n] for n in ("YosoHighErrorRatio", "YosoReplicaNotReady", "YosoTargetDown")} == {"inactive"}

    # Every dashboard query runs on the real series; once rate() has two samples, the core panels
    # have data.
    dashboard = json.loads((kit.DEPLOY / "grafana" / "dashboards" / "yoso-serve.json").read_text())
    core = ("Ready replicas", "Request rate by route and status", "Request latency (p50 / p95 / p99)",
            "Queue wait (p50 / p95 / p99)", "Batch size (items)", "Tokens/s by replica", "Model per replica")

    def panels_with_data():
        results = {}
        for panel in dashboard["panels"]:
            for t in panel["targets"]:
                expr = t["expr"].replace("$__rate_interval", "1m").replace("$job", ".*").replace("$instance", ".*")
                results[(panel["title"], t["refId"])] = kit.prom_query(prom, expr)
        return results if all(results[(title, "A")] for title in core) else None

    results = kit.wait_until(panels_with_data, 30, "data in the core dashboard panels")
    (info,) = results[("Model per replica", "A")]
    assert info["metric"]["backend"] == "torch" and info["metric"]["device"] == "cpu"

    # SIGTERM drains and exits 0, which is what terminationGracePeriodSeconds is sized for.
    kit.stop(proc)
    assert proc.returncode == 0
