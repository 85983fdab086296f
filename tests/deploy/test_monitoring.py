"""The Prometheus config and alert rules (promtool), the Grafana dashboard (every query is valid
PromQL over metrics the service really exposes) and the compose file that wires them together."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml


def promtool(kit, *args, cwd=None):
    return subprocess.run([kit.tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.fixture(scope="module")
def dashboard(kit) -> dict:
    return json.loads((kit.DEPLOY / "grafana" / "dashboards" / "yoso-serve.json").read_text())


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def as_promql(grafana_expr: str) -> str:
    """Grafana's variables replaced the way Grafana does before the query reaches Prometheus."""
    return (grafana_expr.replace("$__rate_interval", "1m").replace("$job", ".*").replace("$instance", ".*"))


def check_exprs_with_promtool(kit, tmp_path, exprs: list[str]):
    rules = {"groups": [{"name": "check", "rules": [{"record": f"check:expr{i}", "expr": e}
                                                    for i, e in enumerate(exprs)]}]}
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    return promtool(kit, "check", "rules", str(path))


def test_promtool_accepts_config_and_rules(kit):
    result = promtool(kit, "check", "config", str(kit.DEPLOY / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout
    result = promtool(kit, "check", "rules", str(kit.DEPLOY / "prometheus" / "rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_fire_on_their_scenarios(kit):
    # tests/deploy/alerts_test.yml: each alert fires only after its `for:` window, on the right series.
    result = promtool(kit, "test", "rules", "alerts_test.yml", cwd=kit.REPO / "tests" / "deploy")
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {r["alert"] for g in yaml.safe_load((kit.DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
              for r in g["rules"]}
    tested = set(re.findall(r"alertname: (\w+)", (kit.REPO / "tests" / "deploy" / "alerts_test.yml").read_text()))
    assert alerts == tested == {"YosoHighErrorRatio", "YosoQueueWaitHigh", "YosoRequestsRefused",
                                "YosoReplicaNotReady", "YosoTargetDown"}


def test_dashboard_queries_are_valid_promql(kit, tmp_path, dashboard):
    exprs = [as_promql(e) for e in dashboard_exprs(dashboard)]
    result = check_exprs_with_promtool(kit, tmp_path, exprs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout
    # The check is real: a broken query is refused the same way.
    broken = check_exprs_with_promtool(kit, tmp_path, exprs + ["sum by (le (rate(yoso_batch_size_bucket[1m]))"])
    assert broken.returncode != 0


def test_every_referenced_metric_is_exposed_by_the_service(kit, dashboard):
    exposed = kit.exposed_metric_names()
    used: dict[str, set[str]] = {"dashboard": set(), "rules": set(), "adapter": set()}
    for e in dashboard_exprs(dashboard):
        used["dashboard"] |= kit.referenced_metric_names(e)
    used["rules"] = kit.referenced_metric_names((kit.DEPLOY / "prometheus" / "rules.yml").read_text())
    adapter = yaml.safe_load((kit.DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml").read_text())
    for rule in adapter["rules"]["custom"]:
        used["adapter"] |= kit.referenced_metric_names(rule["seriesQuery"])
    for where, names in used.items():
        assert names and names <= exposed, f"{where} reads metrics the service does not expose: {names - exposed}"


def test_dashboard_covers_the_issue_panels(kit, dashboard):
    exprs = " ".join(dashboard_exprs(dashboard))
    for metric in ("yoso_requests_total", "yoso_request_duration_seconds_bucket", "yoso_queue_items",
                   "yoso_queue_tokens", "yoso_queue_wait_seconds_bucket", "yoso_batch_size_bucket",
                   "yoso_batch_tokens_bucket", "yoso_tokens_processed_total", "yoso_gpu_memory_bytes",
                   "yoso_failures_total", "yoso_rejections_total", "yoso_admission_predicted_wait_seconds_bucket",
                   "yoso_admission_actual_wait_seconds_bucket"):
        assert metric in exprs, metric
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le, route) (rate(yoso_request_duration_seconds_bucket" in exprs
    assert 'by (route, status)' in exprs and 'status!~"2.."' in exprs
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Every panel queries the provisioned datasource through the dashboard's variable.
    ds = yaml.safe_load((kit.DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert dashboard["templating"]["list"][0]["current"]["value"] == ds["datasources"][0]["uid"]
    assert {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} == {"${datasource}"}


def test_compose_wires_service_prometheus_and_grafana(kit):
    compose = yaml.safe_load((kit.DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    gpu, cpu = services["yoso-serve"], services["yoso-serve-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert gpu["build"]["args"]["FLAVOR"] == "gpu" and cpu["build"]["args"]["FLAVOR"] == "cpu"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "deploy" not in cpu
    # Prometheus scrapes one name; whichever profile runs answers to it.
    prom_config = yaml.safe_load((kit.DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom_config["scrape_configs"] if j["job_name"] == "yoso-serve")
    host, port = job["static_configs"][0]["targets"][0].split(":")
    assert host == "yoso-serve" and "yoso-serve" in cpu["networks"]["default"]["aliases"]
    assert all(s["ports"] == [f"{port}:{port}"] for s in (gpu, cpu))
    # The drain (YOSO_DRAIN_TIMEOUT) ends before compose's SIGKILL.
    for s in (gpu, cpu):
        assert int(s["stop_grace_period"].rstrip("s")) > float(s["environment"]["YOSO_DRAIN_TIMEOUT"])
    # Mounted paths exist and land where each program reads them.
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            src, dst = volume.split(":")[:2]
            if src.startswith("./"):
                assert (kit.DEPLOY / src).is_dir(), volume
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    provider = yaml.safe_load((kit.DEPLOY / "grafana" / "provisioning" / "dashboards" / "yoso-serve.yml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{dash_dir}:ro" in services["grafana"]["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in services["grafana"]["volumes"]
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (kit.DEPLOY / "grafana" / "dashboards" / home.removeprefix(dash_dir + "/")).is_file()
    ds = yaml.safe_load((kit.DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
