"""Cluster manifests (no Ray, no cluster): they parse, agree with serve_config.yaml and the app
config, and keep the dashboard private."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster import gpu_check, gpu_hardware, sync_manifest
from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
RAYSERVICE = CLUSTER / "rayservice.yaml"
LAUNCHER = CLUSTER / "cluster-launcher.yaml"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(RAYSERVICE.read_text()) if doc]


def kind(name: str) -> list[dict[str, Any]]:
    return [doc for doc in documents() if doc.get("kind") == name]


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    (service,) = kind("RayService")
    return service


@pytest.fixture(scope="module")
def cluster_spec(rayservice: dict[str, Any]) -> dict[str, Any]:
    return dict(rayservice["spec"]["rayClusterConfig"])


@pytest.fixture(scope="module")
def serve_config() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))


@pytest.fixture(scope="module")
def app_config(serve_config: dict[str, Any]) -> AppConfig:
    (app,) = serve_config["applications"]
    return AppConfig.model_validate(app["args"])


@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    return dict(yaml.safe_load(LAUNCHER.read_text()))


def gpu_groups(cluster_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for g in cluster_spec["workerGroupSpecs"] if gpus_per_pod(g) > 0]


def container(group: dict[str, Any]) -> dict[str, Any]:
    return dict(group["template"]["spec"]["containers"][0])


def gpus_per_pod(group: dict[str, Any]) -> int:
    limits = container(group).get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def all_groups(cluster_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]


# --- rayservice.yaml ---------------------------------------------------------------------------


def test_rayservice_parses_as_a_kuberay_v1_rayservice(rayservice: dict[str, Any]) -> None:
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["metadata"]["name"]
    assert isinstance(rayservice["spec"]["serveConfigV2"], str)
    assert {doc["kind"] for doc in documents()} >= {"RayService", "PersistentVolumeClaim"}


def test_serve_config_v2_is_serve_config_yaml(
    rayservice: dict[str, Any], serve_config: dict[str, Any]
) -> None:
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == serve_config
    assert sync_manifest.main(["--check"]) == 0


def test_drains_cover_the_request_timeout(
    rayservice: dict[str, Any], cluster_spec: dict[str, Any], app_config: AppConfig
) -> None:
    """Scale-in, upgrade and delete let every request run to its own deadline: engine and
    router replicas drain that long, GPU pods (every replica runs there) and the old cluster
    after an upgrade stay as long."""
    drain = max(
        app_config.engine.deployment_options()["graceful_shutdown_timeout_s"],
        app_config.router.deployment_options()["graceful_shutdown_timeout_s"],
    )
    assert app_config.engine.graceful_shutdown_timeout_s >= app_config.request_timeout_s
    assert app_config.router.graceful_shutdown_timeout_s >= app_config.request_timeout_s
    for group in gpu_groups(cluster_spec):
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] >= drain
    assert rayservice["spec"]["rayClusterDeletionDelaySeconds"] >= drain


def test_sync_manifest_check_fails_on_drift_and_rewrite_fixes_it(tmp_path: Path) -> None:
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text(RAYSERVICE.read_text())
    changed = tmp_path / "serve_config.yaml"
    changed.write_text(
        (ROOT / "serve_config.yaml").read_text().replace("max_num_seqs: 256", "max_num_seqs: 64")
    )
    args = ["--manifest", str(manifest), "--serve-config", str(changed)]
    assert sync_manifest.main([*args, "--check"]) == 1
    assert manifest.read_text() == RAYSERVICE.read_text()  # --check writes nothing
    assert sync_manifest.main(args) == 0
    assert sync_manifest.main([*args, "--check"]) == 0
    assert sync_manifest.embedded_config(manifest.read_text()) == yaml.safe_load(
        changed.read_text()
    )
    # Only the block changed: everything outside serveConfigV2 is byte for byte the same.
    before = [line for line in RAYSERVICE.read_text().splitlines() if "max_num_seqs" not in line]
    after = [line for line in manifest.read_text().splitlines() if "max_num_seqs" not in line]
    assert before == after


def test_gpu_worker_group_offers_the_placement_groups_gpus(
    cluster_spec: dict[str, Any], app_config: AppConfig
) -> None:
    placement = app_config.engine.placement()
    assert placement is not None, "the production engine must run in a GPU placement group"
    bundles, strategy = placement
    gpus = sum(bundle.get("GPU", 0) for bundle in bundles)
    cpus = sum(bundle.get("CPU", 0) for bundle in bundles)
    assert gpus == app_config.engine.world_size == 4
    groups = gpu_groups(cluster_spec)
    assert groups, "no worker group requests nvidia.com/gpu"
    # STRICT_PACK puts every bundle on one node: one pod must hold them all.
    fitting = [g for g in groups if gpus_per_pod(g) >= gpus]
    assert strategy == "STRICT_PACK"
    assert fitting, f"no GPU pod with >= {gpus} GPUs"
    for group in fitting:
        resources = container(group)["resources"]
        assert resources["requests"] == resources["limits"]  # Guaranteed QoS
        assert float(resources["limits"]["cpu"]) >= cpus
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    replicas = app_config.engine.num_replicas
    wanted = app_config.engine.max_replicas if replicas == "auto" else replicas
    assert sum(g["maxReplicas"] * (gpus_per_pod(g) // gpus) for g in fitting) >= wanted


def test_gpu_pods_get_shared_memory_for_nccl(cluster_spec: dict[str, Any]) -> None:
    for group in gpu_groups(cluster_spec):
        spec = group["template"]["spec"]
        shm = {
            v["name"] for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        mounts = {
            m["name"] for m in container(group)["volumeMounts"] if m["mountPath"] == "/dev/shm"
        }
        assert shm & mounts, f"{group['groupName']}: no memory-backed /dev/shm"


def test_autoscaling_is_on(cluster_spec: dict[str, Any]) -> None:
    assert cluster_spec["enableInTreeAutoscaling"] is True


def test_engines_autoscale_onto_the_gpu_pods_the_cluster_may_add(
    cluster_spec: dict[str, Any], app_config: AppConfig
) -> None:
    """serve_config.yaml scales engine replicas 1..N on queue depth with Serve's delays kept;
    the GPU worker groups offer exactly the pods those N replicas need."""
    engine = app_config.engine
    assert engine.num_replicas == "auto" and engine.autoscaling.policy == "queue_depth"
    assert engine.autoscaling.downscale_delay_s >= 60 and engine.autoscaling.upscale_delay_s > 0
    options = engine.deployment_options()["autoscaling_config"]
    assert (options["min_replicas"], options["max_replicas"]) == (
        engine.min_replicas,
        engine.max_replicas,
    )
    per_pod = [gpus_per_pod(g) // engine.world_size for g in gpu_groups(cluster_spec)]
    groups = gpu_groups(cluster_spec)
    assert sum(n * g["maxReplicas"] for n, g in zip(per_pod, groups, strict=True)) == (
        engine.max_replicas
    )
    assert sum(n * g["minReplicas"] for n, g in zip(per_pod, groups, strict=True)) >= (
        engine.min_replicas
    )


def test_probes_point_at_health(cluster_spec: dict[str, Any], serve_config: dict[str, Any]) -> None:
    port = serve_config["http_options"]["port"]
    for group in gpu_groups(cluster_spec):
        probe = container(group)["readinessProbe"]["httpGet"]
        assert (probe["path"], probe["port"]) == ("/health", port)
        assert {"containerPort": port, "name": "serve"} in container(group)["ports"]
    # Every container has both probes; none restarts a pod because the *app* is unhealthy
    # (a liveness on /health would restart GPU pods mid weight-load, or all of them at once).
    for group in all_groups(cluster_spec):
        probes = container(group)
        assert probes.get("readinessProbe") and probes.get("livenessProbe")
        assert probes["livenessProbe"].get("httpGet", {}).get("path") != "/health"
    # The head must be Ready before the app can start (operator and workers reach it first).
    head = container(cluster_spec["headGroupSpec"])
    assert head["readinessProbe"].get("httpGet", {}).get("path") != "/health"


def test_dashboard_is_not_exposed_publicly(cluster_spec: dict[str, Any]) -> None:
    head = cluster_spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    host = head["rayStartParams"].get("dashboard-host", "0.0.0.0")
    if host in LOOPBACK:
        return
    # KubeRay's operator talks to the dashboard through the head Service, so inside the pod it
    # can't be loopback-only; then it must be fenced: token auth + a NetworkPolicy that admits
    # port 8265 from the operator only.
    assert cluster_spec.get("authOptions", {}).get("mode") == "token"
    (policy,) = kind("NetworkPolicy")
    head_labels = head["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= head_labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if not ports or 8265 in ports:  # a rule that admits the dashboard port
            assert rule.get("from"), f"rule admits port 8265 from anywhere: {rule}"


def test_metrics_port_is_exported(cluster_spec: dict[str, Any]) -> None:
    for group in all_groups(cluster_spec):
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        assert {"containerPort": 8080, "name": "metrics"} in container(group)["ports"]


def _claim(name: str) -> dict[str, Any]:
    (found,) = [c for c in kind("PersistentVolumeClaim") if c["metadata"]["name"] == name]
    return found


def test_every_pod_reads_the_model_from_the_shared_volume(cluster_spec: dict[str, Any]) -> None:
    pvc = _claim("serve-app-model-cache")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    for group in all_groups(cluster_spec):
        spec, main = group["template"]["spec"], container(group)
        claims = {
            v["name"]
            for v in spec["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
        }
        mounts = [m["mountPath"] for m in main["volumeMounts"] if m["name"] in claims]
        env = {e["name"]: e.get("value") for e in main["env"]}
        for variable in ("HF_HOME", "SERVE_APP_CACHE"):
            assert any(str(env.get(variable, "")).startswith(m) for m in mounts), variable


def test_the_batch_store_is_on_the_head_nodes_own_volume(
    cluster_spec: dict[str, Any], serve_config: dict[str, Any]
) -> None:
    """SQLite never on a network filesystem: a ReadWriteOnce claim mounted on the head pod only,
    where the coordinator is pinned, and $SERVE_APP_BATCH_DIR on it."""
    pvc = _claim("serve-app-batches")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in pvc["spec"]
    head = cluster_spec["headGroupSpec"]
    volumes = {
        v["name"]
        for v in head["template"]["spec"]["volumes"]
        if v.get("persistentVolumeClaim", {}).get("claimName") == "serve-app-batches"
    }
    mounts = [m["mountPath"] for m in container(head)["volumeMounts"] if m["name"] in volumes]
    env = {e["name"]: e.get("value") for e in container(head)["env"]}
    assert mounts and str(env["SERVE_APP_BATCH_DIR"]).startswith(mounts[0])
    for group in cluster_spec["workerGroupSpecs"]:
        claims = {
            v.get("persistentVolumeClaim", {}).get("claimName")
            for v in group["template"]["spec"]["volumes"]
        }
        assert "serve-app-batches" not in claims
    batch_api = serve_config["applications"][0]["args"]["batch_api"]
    assert "node:__internal_head__" in batch_api["coordinator_resources"]
    assert batch_api["coordinator_num_cpus"] == 0  # The head advertises num-cpus 0.


def test_image_and_ray_versions_agree(
    cluster_spec: dict[str, Any], launcher: dict[str, Any]
) -> None:
    ray_version = cluster_spec["rayVersion"]
    pin = re.search(r'"ray\[[^\]]*\]==([0-9.*]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and ray_version.startswith(pin.group(1).rstrip("*").rstrip("."))
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray_version}-py311-gpu" in dockerfile
    assert "[gpu]" in dockerfile
    assert launcher["docker"]["image"] == f"rayproject/ray:{ray_version}-py311-gpu"


# --- cluster-launcher.yaml ---------------------------------------------------------------------


def test_cluster_launcher_parses_and_has_a_4_gpu_worker_type(
    launcher: dict[str, Any], app_config: AppConfig
) -> None:
    types = launcher["available_node_types"]
    assert launcher["head_node_type"] in types
    placement = app_config.engine.placement()
    assert placement is not None
    gpus = sum(bundle.get("GPU", 0) for bundle in placement[0])
    gpu_types = {
        name: t
        for name, t in types.items()
        if name != launcher["head_node_type"] and t.get("resources", {}).get("GPU", 0) >= gpus
    }
    assert gpu_types, f"no worker type with >= {gpus} GPUs"
    assert gpus >= 4
    for node_type in gpu_types.values():
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"] <= launcher["max_workers"]
    assert any("[gpu]" in command for command in launcher["setup_commands"])


def test_cluster_launcher_dashboard_binds_to_loopback(launcher: dict[str, Any]) -> None:
    command = " ".join(launcher["head_start_ray_commands"])
    hosts = re.findall(r"--dashboard-host[= ](\S+)", command)
    assert hosts and all(host in LOOPBACK for host in hosts), hosts
    assert "--head" in shlex.split(command.replace(";", " "))


# --- gpu_check ---------------------------------------------------------------------------------


def test_gpu_check_parses_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--concurrency" in capsys.readouterr().out
    args = gpu_check.parse_args(["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--tp", "1"])
    assert (args.requests, args.concurrency) == (32, 8)
    assert gpu_check.app_overrides(args) == {
        "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "served_model_name": None},
        "engine": {"tensor_parallel_size": 1},
    }


def test_gpu_check_fails_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_hardware, "list_gpus", lambda: [])
    with pytest.raises(gpu_check.CheckFailed, match="needs 4 GPUs"):
        gpu_check.preflight(4)


def test_gpu_check_reports_the_engines_placement_group() -> None:
    """From ray.util.placement_group_table()'s shape: created groups holding GPUs only."""
    table = {
        "a1": {
            "state": "CREATED",
            "strategy": "STRICT_PACK",
            "bundles": {0: {"CPU": 1.0, "GPU": 1.0}, 1: {"GPU": 1.0}},
            "bundles_to_node_id": {0: "f00dfeed00aa", 1: "f00dfeed00aa"},
        },
        "b2": {"state": "CREATED", "strategy": "PACK", "bundles": {0: {"CPU": 1.0}}},
        "c3": {"state": "REMOVED", "strategy": "PACK", "bundles": {0: {"GPU": 1.0}}},
    }
    assert gpu_check.gpu_placement_groups(table) == [
        {
            "strategy": "STRICT_PACK",
            "bundles": [{"CPU": 1.0, "GPU": 1.0}, {"GPU": 1.0}],
            "nodes": ["f00dfeed", "f00dfeed"],
        }
    ]
