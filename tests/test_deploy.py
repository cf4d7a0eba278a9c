"""docker/ and the alert rules, checked with the tools that run without a Docker engine.

promtool comes from Debian's ``prometheus`` package (``.ci/run`` installs it); the tests that
need it skip, saying so, only where it is absent. ``nats-server`` is the one the suite runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from reach_mesh.server import find_nats_server

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
RULES = sorted((DOCKER / "rules").glob("*.yml"))
RULE_TESTS = sorted((DOCKER / "rules" / "tests").glob("*.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install prometheus; .ci/run does this)",
)


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    return data


def _prometheus() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    return data


# -- alert rules ---------------------------------------------------------------------------


def test_rule_files_and_their_tests_are_shipped() -> None:
    assert RULES, "no rule files in docker/rules"
    assert RULE_TESTS, "no promtool unit tests in docker/rules/tests"
    tested = set()
    for test_file in RULE_TESTS:
        for name in yaml.safe_load(test_file.read_text())["rule_files"]:
            tested.add((test_file.parent / name).resolve())
    assert tested == {r.resolve() for r in RULES}, "every rule file needs a unit test file"


@needs_promtool
@pytest.mark.parametrize("rules", RULES, ids=lambda p: p.name)
def test_promtool_check_rules(rules: Path) -> None:
    out = promtool("check", "rules", str(rules))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
@pytest.mark.parametrize("tests", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(tests: Path) -> None:
    out = promtool("test", "rules", str(tests))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_firing_unit_test() -> None:
    alerts = {
        rule["alert"]
        for path in RULES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    fired = {
        case["alertname"]
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert "ReachHubDown" in alerts
    assert alerts <= fired, f"alerts never shown firing: {sorted(alerts - fired)}"


def test_every_runbook_names_a_section_of_operations_md() -> None:
    """An alert's runbook annotation is a link into docs/operations.md: its anchor must be one
    of that file's headings, as GitHub makes them (lower case, punctuation but hyphens gone,
    spaces as hyphens)."""
    doc = ROOT / "docs" / "operations.md"
    anchors = {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in doc.read_text().splitlines()
        if line.startswith("#")
    }
    runbooks = {
        rule["annotations"]["runbook"]
        for path in RULES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "runbook" in rule.get("annotations", {})
    }
    assert runbooks, "no alert has a runbook"
    linked = {r.partition("#")[2] for r in runbooks if r.startswith("docs/operations.md#")}
    assert linked == {r.partition("#")[2] for r in runbooks}, "a runbook outside operations.md"
    assert linked <= anchors, f"runbooks naming no section: {sorted(linked - anchors)}"


def test_rules_select_jobs_that_prometheus_scrapes() -> None:
    """The seed shipped job ``reach-hubs`` and a rule on ``up{job="reach-hub"}``: the hub-down
    alert could never fire. Every job a rule names must be a scrape job."""
    jobs = {c["job_name"] for c in _prometheus()["scrape_configs"]}
    named = {job for path in RULES for job in re.findall(r'job\s*=\s*"([^"]+)"', path.read_text())}
    assert named, "no rule selects a job"
    assert named <= jobs, f"rules select jobs nobody scrapes: {sorted(named - jobs)}"


def test_rules_use_only_metric_names_the_code_exports() -> None:
    from reach_mesh.tracing.metrics import AgentMetrics, HubMetrics, connection_metrics

    agent = AgentMetrics("ns.svc.a1", "ns")  # (as every Agent makes it: with its id)
    agent.step_counts(dict)  # (exported by agents that take workflow steps)
    exported = set()
    for metrics in (HubMetrics(), agent):
        # (exported by every hub and agent, from their connection)
        connection_metrics(metrics.registry, lambda: (0, {"main": (0, True, 3)}))
        for family in metrics.registry.collect():
            exported.add(family.name)
            for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
                exported.add(family.name + suffix)
    used = {name for path in RULES for name in re.findall(r"\b(reach_[a-z_]+)\b", path.read_text())}
    assert used, "the rules use no reach_* metric"
    assert used <= exported, f"rules use metrics the code does not export: {used - exported}"


# -- prometheus.yml --------------------------------------------------------------------------


@needs_promtool
def test_promtool_check_config() -> None:
    out = promtool("check", "config", str(DOCKER / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    # The rules are loaded from the config, not only shipped next to it.
    assert f"SUCCESS: {len(RULES)} rule files found" in out.stdout


# -- nats.conf ---------------------------------------------------------------------------------


def test_nats_config_is_valid(tmp_path: Path) -> None:
    """``nats-server -t`` on docker/nats.conf, with the auth config it includes generated as
    docker/README.md says (``reach-mesh auth init docker/auth``), here into a copy."""
    conf = (DOCKER / "nats.conf").read_text()
    (tmp_path / "nats.conf").write_text(conf)
    if 'include "auth/auth.conf"' in conf:
        subprocess.run(
            [sys.executable, "-m", "reach_mesh.cli", "auth", "init", str(tmp_path / "auth")],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    out = subprocess.run(
        [find_nats_server(), "-t", "-c", "nats.conf"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "is valid" in out.stdout + out.stderr


# -- docker-compose.yml, Dockerfile, .dockerignore ---------------------------------------------


def test_compose_services_are_pinned_healthy_and_restarting() -> None:
    services = _compose()["services"]
    assert {"nats-1", "nats-2", "nats-3", "hub-1", "hub-2", "prometheus", "jaeger"} <= set(services)
    for name, svc in services.items():
        assert svc.get("restart") in {"unless-stopped", "always"}, name
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        image = svc.get("image")
        if "build" not in svc:
            assert image and ":" in image and not image.endswith(":latest"), (name, image)
    # The NATS image is the version the suite tests against.
    nats_version = subprocess.run(
        [find_nats_server(), "--version"], capture_output=True, text=True, check=True
    ).stdout
    tested = re.search(r"v(\d+\.\d+\.\d+)", nats_version)
    assert tested is not None
    for name in ("nats-1", "nats-2", "nats-3"):
        assert services[name]["image"].startswith(f"nats:{tested.group(1)}"), name
    # Hubs wait for a healthy NATS cluster.
    for name in ("hub-1", "hub-2"):
        deps = services[name]["depends_on"]
        for node in ("nats-1", "nats-2", "nats-3"):
            assert deps[node]["condition"] == "service_healthy", (name, node)


def test_compose_hubs_can_read_the_key_files_of_auth_init() -> None:
    """``reach-mesh auth init`` writes the seeds mode 0600, owned by whoever ran it: the image's
    own user (uid 10001) cannot read them through a bind mount on a Linux engine, so the hubs run
    as the invoking user, and compose refuses to start without it."""
    services = _compose()["services"]
    assert "--uid 10001" in (DOCKER / "Dockerfile").read_text()
    for name in ("hub-1", "hub-2"):
        svc = services[name]
        assert any(v.startswith("./auth/hub.main.nk:") for v in svc["volumes"]), name
        user = svc.get("user")
        assert user is not None, f"{name} runs as the image's uid 10001"
        uid, gid = user.split("}:")
        assert uid.startswith("${REACH_UID:?") and gid.startswith("${REACH_GID:?"), user
    assert "export REACH_UID=$(id -u) REACH_GID=$(id -g)" in (DOCKER / "README.md").read_text()


def test_compose_keeps_each_nats_nodes_jetstream_in_a_named_volume() -> None:
    """nats.conf stores JetStream in /data: a volume per node, or ``docker compose down`` loses
    the registry, the workflows and the audit trail."""
    store = re.search(r"store_dir:\s*(\S+?)\s*}", (DOCKER / "nats.conf").read_text())
    assert store is not None
    compose = _compose()
    declared = set(compose.get("volumes") or {})
    used = set()
    for name in ("nats-1", "nats-2", "nats-3"):
        mounts = dict(v.split(":")[:2] for v in compose["services"][name]["volumes"])
        assert mounts["./nats.conf"] == "/etc/nats/nats.conf", name
        assert mounts["./auth/auth.conf"] == "/etc/nats/auth/auth.conf", name
        data = [source for source, target in mounts.items() if target == store.group(1)]
        assert len(data) == 1 and data[0] in declared, (name, mounts, declared)
        used.add(data[0])
    assert len(used) == 3, "each node needs a store of its own"


def test_compose_wires_prometheus_rules_and_traces() -> None:
    services = _compose()["services"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in services["prometheus"]["volumes"])
    assert mounts["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    rules_dir = mounts["./rules"]
    # prometheus.yml names its rule files relative to itself: they resolve into the mount.
    for pattern in _prometheus()["rule_files"]:
        assert f"/etc/prometheus/{pattern}".startswith(rules_dir + "/"), pattern
    for source in mounts:
        assert (DOCKER / source).exists(), source
    # Every scrape target is a service, on the port its hub serves HTTP on.
    for config in _prometheus()["scrape_configs"]:
        for static in config["static_configs"]:
            for target in static["targets"]:
                host, port = target.split(":")
                assert host in services, target
                assert services[host]["environment"]["REACH_HTTP_PORT"] == port
    # Traces: the hubs export OTLP/HTTP to the Jaeger service (4318, its OTLP HTTP port).
    for name in ("hub-1", "hub-2"):
        env = services[name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_compose_config_with_docker_compose() -> None:
    """``docker-compose config`` validates the file against the Compose schema without an
    engine (Debian's ``docker-compose`` package, or the ``docker compose`` plugin)."""
    if shutil.which("docker-compose"):
        command = ["docker-compose"]
    elif (
        shutil.which("docker")
        and (
            subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        ).returncode
        == 0
    ):
        command = ["docker", "compose"]
    else:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")

    def config(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "-f", "docker-compose.yml", "config"],
            cwd=DOCKER,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"PATH": "/usr/bin:/bin", "REACH_HTTP_TOKEN": "t" * 24, **env},
        )

    # Without the owner of docker/auth the hubs could not read their key: refused, saying why.
    refused = config()
    assert refused.returncode != 0 and "REACH_UID" in refused.stderr, refused
    out = config(REACH_UID="1234", REACH_GID="5678")
    assert out.returncode == 0, out.stdout + out.stderr
    compose: dict[str, Any] = yaml.safe_load(out.stdout)
    assert "prometheus" in compose["services"]
    assert compose["services"]["hub-1"]["user"] == "1234:5678"
    assert {"nats-1-data", "nats-2-data", "nats-3-data"} <= set(compose["volumes"])


def test_dockerfile_copies_what_exists_and_context_excludes_the_venv() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim-\w+$", dockerfile, re.M)
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), source
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git", "**/__pycache__", ".mypy_cache", ".pytest_cache"} <= ignored
    # What the image needs is not ignored.
    assert not ignored & {"reach_mesh", "pyproject.toml", "README.md"}
