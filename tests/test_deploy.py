"""deploy/: the Kubernetes manifests against the Kubernetes schemas, the Prometheus rules with
promtool (checked and unit-tested), and every series the rules and the Grafana dashboard use
against what a real server exposes."""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import celery_dflock
from dflockd_server import Config
from dflockd_server.settings import SETTINGS
from dflockd_server.testing import ServerThread
from tests.support.etcd import EtcdServer, etcd_or_skip
from tests.support.ports import free_port
from tests.support.wire import Wire

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
RULES = DEPLOY / "prometheus" / "dflockd-rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "dflockd-rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "dflockd-dashboard.json"
# The oldest Kubernetes still in common use, and the newest the schemas know.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")


def _documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in MANIFESTS:
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _by_kind(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    docs = _documents()
    assert {d["kind"] for d in docs} >= {
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_manifests_fit_the_server_and_each_other() -> None:
    server = _containers(_by_kind("StatefulSet", "dflockd"))[0]
    known = {name for setting in SETTINGS for name in setting.env}
    env_names = {e["name"] for e in server["env"]}
    assert env_names <= known, f"unknown server variables: {env_names - known}"
    assert server["image"].endswith(f":{celery_dflock.__version__}")
    probe = ["python", "-m", "dflockd_server.health"]
    assert server["readinessProbe"]["exec"]["command"] == probe
    assert server["livenessProbe"]["exec"]["command"] == probe
    service = _by_kind("Service", "dflockd")
    port = next(e["value"] for e in server["env"] if e["name"] == "DFLOCKD_PORT")
    assert {p["port"] for p in service["spec"]["ports"]} >= {int(port)}
    # Every worker and every beat names the same servers: the one Service.
    servers = {
        e["value"]
        for name in ("celery-worker", "celery-beat")
        for c in _containers(_by_kind("Deployment", name))
        for e in c["env"]
        if e["name"] == "DFLOCK_SERVERS"
    }
    assert servers == {f"dflockd:{port}"}


STATE_DIR = "/var/lib/dflockd"
"""Where the image keeps its state (DFLOCKD_STATE_DIR in server/Dockerfile)."""


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def test_every_dflockd_container_keeps_its_state_dir_on_a_persistent_volume() -> None:
    workloads = [d for d in _documents() if d["kind"] in {"StatefulSet", "Deployment", "Pod"}]
    servers = [
        (doc, container)
        for doc in workloads
        for container in _pod_spec(doc)["containers"]
        if container["image"].startswith("dflockd-server:")
    ]
    assert servers, "no dflockd container in deploy/kubernetes"
    for doc, container in servers:
        where = f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("DFLOCKD_STATE_DIR") == STATE_DIR, where
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        assert STATE_DIR in mounts, f"{where}: nothing mounted at {STATE_DIR}"
        volume = mounts[STATE_DIR]
        if doc["kind"] == "StatefulSet":
            claims = {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
            assert volume in claims, f"{where}: {volume} is not a volumeClaimTemplate"
        else:  # an emptyDir would be a lost disk at every new pod
            source = next(v for v in _pod_spec(doc).get("volumes", []) if v["name"] == volume)
            assert "persistentVolumeClaim" in source, f"{where}: {volume} is not persistent"


def _promtool() -> str | None:
    path = shutil.which("promtool")
    in_ci = os.environ.get("CI") == "true" or os.environ.get("CELERY_DFLOCK_REQUIRE_REDIS") == "1"
    if path is None and in_ci:
        pytest.fail("promtool is missing (.ci/run installs Debian's prometheus package)")
    return path


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    for args in (["check", "rules", RULES.name], ["test", "rules", RULES_TEST.name]):
        done = subprocess.run(
            [promtool, *args], cwd=RULES.parent, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr


def _series_used() -> set[str]:
    texts = [RULES.read_text()]
    dashboard = json.loads(DASHBOARD.read_text())
    texts += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    texts += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return set(re.findall(r"\bdflockd_[a-z_]+", "\n".join(texts)))


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    yield from etcd_or_skip(tmp_path)


def _exposed(config: Config) -> set[str]:
    """The series names a server with ``config`` exposes after one request."""
    server = ServerThread(config).start()
    try:
        # One request, so that the per-command histogram has a child to expose.
        tls = ssl.create_default_context(cafile=config.tls_cert) if config.tls_cert else None
        with Wire((server.host, server.port), timeout=5, ssl_context=tls) as conn:
            assert conn.req("ping") == "ok"
        url = server.metrics_url
        assert url is not None
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.stop()
    return {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }


def test_rules_and_dashboard_use_only_series_the_server_exposes(
    etcd_server: EtcdServer, tls_files: tuple[str, str]
) -> None:
    cert, key = tls_files  # a TLS server exposes its certificate's expiry besides
    exposed = _exposed(Config(host="127.0.0.1", port=0, metrics_port=0, tls_cert=cert, tls_key=key))
    assert not any(name.startswith("dflockd_cluster_") for name in exposed)
    # A cluster member exposes the cluster's series besides.
    port = free_port()
    exposed |= _exposed(
        Config(
            host="127.0.0.1",
            port=port,
            metrics_port=0,
            cluster=f"etcd://{etcd_server.url.removeprefix('http://')}/deploy",
            advertise=f"127.0.0.1:{port}",
        )
    )
    used = _series_used()
    assert used, "the rules and the dashboard query no dflockd series"
    assert used <= exposed, f"not exposed by the server: {sorted(used - exposed)}"


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"


def _workloads() -> list[dict[str, Any]]:
    return [d for d in _documents() if d["kind"] in {"StatefulSet", "Deployment", "Pod"}]


def _where(doc: dict[str, Any], container: dict[str, Any] | None = None) -> str:
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    return f"{name}/{container['name']}" if container else name


def test_every_container_meets_the_restricted_pod_security_standard() -> None:
    """The fields the restricted profile checks
    (https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted), for every
    container of every workload: non-root, no privilege escalation, every capability dropped, the
    runtime's default seccomp profile; and nothing the baseline profile forbids."""
    workloads = _workloads()
    assert {_where(d) for d in workloads} >= {
        "StatefulSet/dflockd",
        "Deployment/celery-worker",
        "Deployment/celery-beat",
    }
    for doc in workloads:
        pod = _pod_spec(doc)
        pod_context = pod.get("securityContext", {})
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(flag), f"{_where(doc)}: {flag}"
        for volume in pod.get("volumes", []):
            assert "hostPath" not in volume, f"{_where(doc)}: hostPath volume {volume['name']}"
        containers = [*pod["containers"], *pod.get("initContainers", [])]
        for container in containers:
            where = _where(doc, container)
            context = container.get("securityContext", {})

            def effective(
                field: str, context: dict[str, Any] = context, pod: dict[str, Any] = pod_context
            ) -> Any:
                return context.get(field, pod.get(field))

            assert effective("runAsNonRoot") is True, f"{where}: runAsNonRoot"
            assert effective("runAsUser") != 0, f"{where}: runAsUser 0"
            assert context.get("allowPrivilegeEscalation") is False, f"{where}: escalation"
            assert not context.get("privileged"), f"{where}: privileged"
            capabilities = context.get("capabilities", {})
            assert capabilities.get("drop") == ["ALL"], f"{where}: capabilities not dropped"
            assert set(capabilities.get("add", [])) <= {"NET_BIND_SERVICE"}, where
            seccomp = effective("seccompProfile") or {}
            assert seccomp.get("type") in {"RuntimeDefault", "Localhost"}, f"{where}: seccomp"
            for port in container.get("ports", []):
                assert "hostPort" not in port, f"{where}: hostPort"


def test_the_statefulset_names_a_headless_service() -> None:
    stateful = _by_kind("StatefulSet", "dflockd")
    governing = _by_kind("Service", stateful["spec"]["serviceName"])
    assert governing["spec"].get("clusterIP") == "None", "the StatefulSet's Service is not headless"
    labels = stateful["spec"]["template"]["metadata"]["labels"]
    assert governing["spec"]["selector"].items() <= labels.items()
    # The clients' Service (DFLOCK_SERVERS=dflockd:6388) selects the same pods.
    assert _by_kind("Service", "dflockd")["spec"]["selector"].items() <= labels.items()


def test_the_lock_servers_pods_carry_prometheus_scrape_annotations() -> None:
    stateful = _by_kind("StatefulSet", "dflockd")
    annotations = stateful["spec"]["template"]["metadata"].get("annotations", {})
    container = _containers(stateful)[0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    metrics_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/port") == str(metrics_port) == env["DFLOCKD_METRICS_PORT"]
    assert annotations.get("prometheus.io/path") == "/metrics"


def test_the_scrape_path_is_where_a_real_server_serves_its_metrics() -> None:
    port = free_port()
    with ServerThread(Config(host="127.0.0.1", port=0, metrics_port=port)):
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert b"dflockd_" in body


@pytest.mark.parametrize("name", ["celery-worker", "celery-beat"])
def test_workers_and_beats_have_probes_and_limits(name: str) -> None:
    for container in _containers(_by_kind("Deployment", name)):
        where = f"Deployment/{name}/{container['name']}"
        assert "readinessProbe" in container, f"{where}: no readiness probe"
        if name == "celery-worker":
            probe = container["livenessProbe"]["exec"]["command"]
            assert "inspect ping" in " ".join(probe), f"{where}: {probe}"
        limits = container.get("resources", {}).get("limits", {})
        assert {"cpu", "memory"} <= limits.keys(), f"{where}: limits {limits}"
        ready = container["readinessProbe"]["exec"]["command"]
        assert ready[-2:] == ["dflock", "ping"], f"{where}: {ready}"


def _kubernetes_pods_labels() -> dict[str, str]:
    """The labels Prometheus's common ``kubernetes-pods`` job (the one that keeps pods by their
    ``prometheus.io/*`` annotations, as in Prometheus's example Kubernetes configuration) puts
    on the series of the dflockd pod of deploy/kubernetes: its job, ``instance`` (the pod's
    address and annotated port), each pod label through ``labelmap`` (characters a label name
    cannot hold become ``_``), ``namespace`` and ``pod``."""
    stateful = _by_kind("StatefulSet", "dflockd")
    template = stateful["spec"]["template"]["metadata"]
    port = template["annotations"]["prometheus.io/port"]
    labels = {
        re.sub(r"[^a-zA-Z0-9_]", "_", name): value for name, value in template["labels"].items()
    }
    return {
        **labels,
        "job": "kubernetes-pods",
        "instance": f"10.0.0.7:{port}",
        "namespace": "default",
        "pod": f"{stateful['metadata']['name']}-0",
    }


def test_the_alerts_fire_on_series_labelled_as_the_manifests_are_scraped(tmp_path: Path) -> None:
    """DflockdDown used to match only ``job="dflockd"``, a label the annotation-scraped pod
    never gets, so it could not fire (issue 50); with no target at all, DflockdNotScraped
    fires, and the keys near ``--max-locks`` fire DflockdKeysNearCap."""
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    labels = _kubernetes_pods_labels()
    selector = ", ".join(f'{name}="{value}"' for name, value in sorted(labels.items()))
    max_locks = next(
        e["value"]
        for e in _containers(_by_kind("StatefulSet", "dflockd"))[0]["env"]
        if e["name"] == "DFLOCKD_MAX_LOCKS"
    )
    near = int(int(max_locks) * 0.9)
    rules = {
        rule["alert"]: rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }

    def alert(name: str, **fired: str) -> dict[str, Any]:
        annotations = {
            key: text.replace("{{ $labels.instance }}", fired.get("instance", ""))
            for key, text in rules[name]["annotations"].items()
        }
        return {"exp_labels": {**rules[name]["labels"], **fired}, "exp_annotations": annotations}

    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f"up{{{selector}}}", "values": "1 1 0 0 0"},
                    {"series": f"dflockd_keys_busy{{{selector}}}", "values": f"0 {near}x5"},
                    {"series": f"dflockd_keys_max{{{selector}}}", "values": f"{max_locks}x6"},
                ],
                "alert_rule_test": [
                    {"eval_time": "2m", "alertname": "DflockdDown", "exp_alerts": []},
                    {
                        "eval_time": "4m",
                        "alertname": "DflockdDown",
                        "exp_alerts": [alert("DflockdDown", **labels)],
                    },
                    {"eval_time": "4m", "alertname": "DflockdNotScraped", "exp_alerts": []},
                    {
                        "eval_time": "4m",
                        "alertname": "DflockdKeysNearCap",
                        "exp_alerts": [alert("DflockdKeysNearCap", instance=labels["instance"])],
                    },
                ],
            },
            {
                "interval": "1m",
                "input_series": [{"series": 'up{job="kubernetes-pods"}', "values": "1x8"}],
                "alert_rule_test": [
                    {
                        "eval_time": "7m",
                        "alertname": "DflockdNotScraped",
                        "exp_alerts": [alert("DflockdNotScraped")],
                    }
                ],
            },
        ],
    }
    path = tmp_path / "scraped.test.yml"
    path.write_text(yaml.safe_dump(tests))
    done = subprocess.run(
        [promtool, "test", "rules", path.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
