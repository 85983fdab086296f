"""deploy/k8s rendered per overlay and validated: built-in kinds against the pinned Kubernetes
version's schemas (kubernetes-validate, strict), the ServiceMonitor and the adapter rules
structurally, and the numbers that must agree across objects (ports, labels, drain timing)."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

OVERLAYS = ("gpu", "cpu")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request, kit) -> tuple[str, dict[str, dict]]:
    docs = kit.render_kustomization(kit.DEPLOY / "k8s" / "overlays" / request.param)
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    return request.param, by_kind


def container(objs: dict) -> dict:
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(kit, overlay):
    # CI has no kubectl (not in Debian); where one exists, the small renderer must agree with it.
    kubectl = shutil.which("kubectl")
    ours = kit.render_kustomization(kit.DEPLOY / "k8s" / "overlays" / overlay)
    if kubectl is None:
        assert {d["kind"] for d in ours} == {"Deployment", "Service", "PodDisruptionBudget",
                                            "ServiceMonitor", "HorizontalPodAutoscaler"}
        return
    out = subprocess.run([kubectl, "kustomize", str(kit.DEPLOY / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(ours, key=key) == sorted(theirs, key=key)


def test_builtin_kinds_validate_strictly(kit, rendered):
    _, objs = rendered
    for kind, doc in objs.items():
        if kind == "ServiceMonitor":
            continue
        kubernetes_validate.validate(doc, kit.KUBERNETES_VERSION, strict=True)


def test_validation_rejects_a_misspelt_field(kit, rendered):
    # The schema check is real: a typo that kubectl would silently drop fails strict validation.
    _, objs = rendered
    broken = yaml.safe_load(yaml.safe_dump(objs["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/ready", "port": 80}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kit.KUBERNETES_VERSION, strict=True)


def test_gpu_only_in_the_gpu_overlay(rendered):
    overlay, objs = rendered
    c = container(objs)
    assert c["image"] == f"yoso-serve:{overlay}"
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert {"cpu", "memory"} <= requests.keys() and "memory" in limits
    if overlay == "gpu":
        assert limits["nvidia.com/gpu"] == 1
        tolerations = objs["Deployment"]["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    else:
        assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in requests
        # One torch thread per requested core: more would contend with the node's other pods.
        env = {e["name"]: e["value"] for e in c["env"]}
        assert int(env["YOSO_THREADS"]) == int(requests["cpu"])


def test_probes_hit_the_service_routes(rendered):
    _, objs = rendered
    c = container(objs)
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    assert port_names["http"] == 8080
    # Model load and warm-up get minutes before liveness may restart the pod.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_drain_fits_in_the_grace_period(rendered):
    _, objs = rendered
    spec = objs["Deployment"]["spec"]["template"]["spec"]
    c = container(objs)
    env = {e["name"]: e["value"] for e in c["env"]}
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(env["YOSO_DRAIN_TIMEOUT"])
    # After the preStop sleep, SIGTERM starts the drain; SIGKILL must not come before it ends.
    assert pre_stop >= 5 and spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    # Readiness notices a drain (/ready -> 503) within two periods, well inside the sleep.
    r = c["readinessProbe"]
    assert r["periodSeconds"] * r["failureThreshold"] <= pre_stop


def test_runs_non_root_on_a_read_only_root(rendered):
    _, objs = rendered
    spec = objs["Deployment"]["spec"]["template"]["spec"]
    c = container(objs)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    # Nothing hides what the image baked in: the model and the compiled kernels under /opt/yoso.
    assert not any(path.startswith("/opt/yoso") for path in mounts)


def test_objects_select_each_other(rendered):
    _, objs = rendered
    deployment, service, pdb = objs["Deployment"], objs["Service"], objs["PodDisruptionBudget"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container(objs)["ports"]}
    monitor = objs["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    hpa = objs["HorizontalPodAutoscaler"]
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    # The HPA owns the replica count; the PDB never blocks a drain of a minimal deployment.
    assert "replicas" not in deployment["spec"]
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"] >= 1
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_autoscaler_metrics_are_served_by_the_adapter(kit, rendered, tmp_path):
    overlay, objs = rendered
    adapter = yaml.safe_load((kit.DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml").read_text())
    served = {r["name"]["as"]: r for r in adapter["rules"]["custom"]}
    metrics = objs["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Pods", "Pods"]
    names = [m["pods"]["metric"]["name"] for m in metrics]
    assert names == ["yoso_queue_tokens", "yoso_queue_wait_seconds_p95"]
    assert set(names) <= served.keys()
    tokens_target = int(metrics[0]["pods"]["target"]["averageValue"])
    assert tokens_target == (16384 if overlay == "gpu" else 4096)
    # Each rule turns into valid PromQL once the adapter fills its template (checked by promtool).
    exprs = []
    for rule in served.values():
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        series = rule["seriesQuery"].split("{")[0]
        exprs.append(rule["metricsQuery"].replace("<<.Series>>", series)
                     .replace("<<.LabelMatchers>>", 'namespace="default", pod=~"yoso-serve-.*"')
                     .replace("<<.GroupBy>>", "pod"))
    rules = {"groups": [{"name": "adapter", "rules": [{"record": f"adapter:q{i}", "expr": e}
                                                      for i, e in enumerate(exprs)]}]}
    (tmp_path / "adapter.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([kit.tool("promtool"), "check", "rules", str(tmp_path / "adapter.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_init_container_hands_the_compiled_kernels_to_the_server(kit, rendered):
    _, objs = rendered
    spec = objs["Deployment"]["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    c = container(objs)
    assert init["image"] == c["image"] and init["securityContext"]["readOnlyRootFilesystem"] is True
    # The copy's source is where the image built the kernels, its target where the server looks.
    image_env = kit.dockerfile_env("runtime")
    cp, flags, src, dest = init["command"]
    assert (cp, flags) == ("cp", "-a") and src == image_env["TORCH_EXTENSIONS_DIR"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TORCH_EXTENSIONS_DIR"] == dest.rstrip("/") + "/" + src.rsplit("/", 1)[1]
    # ... through one emptyDir volume mounted at the same path in both containers.
    (init_mount,) = init["volumeMounts"]
    assert init_mount["mountPath"] == dest.rstrip("/")
    assert {"name": init_mount["name"], "mountPath": init_mount["mountPath"]} in c["volumeMounts"]
    assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}[init_mount["name"]]
