"""docker-compose.yml checked against the code, since Docker cannot run in the test suite.

Each command a service or healthcheck runs parses with the real `asyncflow` CLI,
each ASYNCFLOW_* variable is a setting something reads, each profile's
dependencies are there (or optional), and the mounted files and the Grafana
dashboard agree with the repository and the metric names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

from asyncflow.cli import main
from modules.mysql import MysqlSettings
from shared.config import Settings
from shared.flows import load_flows

REPO = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROFILES = sorted({p for s in SERVICES.values() for p in s.get("profiles", [])})
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "asyncflow.json"

# The metrics the dashboard may query (shared/metrics.py, oss_api/metrics.py).
METRICS = {
    "asyncflow_step_seconds", "asyncflow_step_attempts_total", "asyncflow_step_retries_total",
    "asyncflow_rollbacks_total", "asyncflow_alarms_total", "asyncflow_stale_messages_total",
    "asyncflow_queue_depth", "asyncflow_step_queue_wait_seconds", "asyncflow_tasks_submitted_total",
    "asyncflow_tasks_finished_total", "asyncflow_v1_leases_active", "asyncflow_v1_lease_expiries_total",
    "asyncflow_v1_tasks_created_total", "asyncflow_scheduler_leader", "asyncflow_schedule_lateness_seconds",
    "asyncflow_schedule_runs_total", "asyncflow_processes", "asyncflow_step_heartbeats_total",
    "asyncflow_attempts_expired_total",
}
HISTOGRAMS = {"asyncflow_step_seconds", "asyncflow_step_queue_wait_seconds", "asyncflow_schedule_lateness_seconds"}


def asyncflow_commands() -> Iterator[tuple[str, list[str]]]:
    """Every `asyncflow ...` argv of a service's command or healthcheck."""
    for name, service in SERVICES.items():
        command = service.get("command")
        if isinstance(command, list) and command[:1] == ["asyncflow"]:
            yield f"{name} command", command[1:]
        test = service.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "asyncflow"]:
            yield f"{name} healthcheck", test[2:]


def parse(args: list[str]) -> click.Context:
    """Parse ``args`` as `asyncflow` would (options, choices, argument counts), without running it."""
    command: click.Command = main
    ctx = main.make_context("asyncflow", [], resilient_parsing=True)
    while isinstance(command, click.Group):
        assert args, f"{command.name} needs a subcommand"
        sub = command.get_command(ctx, args[0])
        assert sub is not None, f"no such command: {args[0]!r} under {command.name}"
        command, args = sub, args[1:]
        ctx = command.make_context(command.name or "", list(args), parent=ctx, resilient_parsing=isinstance(command, click.Group))
    return ctx


def test_there_are_commands_to_check() -> None:
    assert {label for label, _ in asyncflow_commands()} >= {"oss_api command", "scheduler command", "mysql healthcheck"}


@pytest.mark.parametrize(("label", "args"), list(asyncflow_commands()))
def test_each_command_is_a_real_cli_command(label: str, args: list[str]) -> None:
    try:
        parse(args)
    except click.UsageError as exc:
        pytest.fail(f"{label}: `asyncflow {' '.join(args)}`: {exc.format_message()}")


def test_the_check_itself_refuses_what_the_cli_refuses() -> None:
    with pytest.raises(click.UsageError):
        parse(["worker", "--no-such-option", "mysql"])
    with pytest.raises(click.UsageError):
        parse(["health", "janitor"])
    with pytest.raises(AssertionError, match="no such command"):
        parse(["serve"])


def test_workers_consume_modules_of_the_image_flows() -> None:
    modules = load_flows(REPO / "flows.yaml").push_module_names()
    served = {m for label, args in asyncflow_commands() if args[0] == "worker" and "command" in label for m in args[1:]}
    assert served == modules


def settings_read() -> set[str]:
    """Every ASYNCFLOW_* variable some settings object reads."""
    names = {f"ASYNCFLOW_{field.upper()}" for field in Settings.model_fields}
    names |= {f"ASYNCFLOW_MYSQL_{field.upper()}" for field in MysqlSettings.model_fields}
    return names


@pytest.mark.parametrize("name", list(SERVICES))
def test_each_asyncflow_variable_is_read(name: str) -> None:
    unknown = {k for k in SERVICES[name].get("environment", {}) if k.startswith("ASYNCFLOW_")} - settings_read()
    assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"


def active(profiles: set[str]) -> set[str]:
    return {n for n, s in SERVICES.items() if not s.get("profiles") or profiles & set(s["profiles"])}


@pytest.mark.parametrize(
    "profiles", [set()] + [set(c) for k in (1, 2) for c in combinations(PROFILES, k)], ids=lambda p: "+".join(sorted(p)) or "none"
)
def test_dependencies_exist_in_each_profile_or_are_optional(profiles: set[str]) -> None:
    running = active(profiles)
    for name in running:
        depends = SERVICES[name].get("depends_on", {})
        for target, how in (depends.items() if isinstance(depends, dict) else ((d, {}) for d in depends)):
            assert target in SERVICES, f"{name} depends on undefined {target}"
            if target not in running:
                assert how.get("required") is False, f"{name} needs {target}, not running with {sorted(profiles)}"


def test_brokers_are_profiles_and_the_default_url_names_the_rabbitmq_service() -> None:
    assert {"rabbitmq", "redis", "metrics"} <= set(PROFILES)
    assert SERVICES["rabbitmq"]["profiles"] == ["rabbitmq"] and SERVICES["redis"]["profiles"] == ["redis"]
    url = SERVICES["oss_api"]["environment"]["ASYNCFLOW_BROKER_URL"]
    default = re.fullmatch(r"\$\{ASYNCFLOW_BROKER_URL:-(.+)\}", url)
    assert default, f"the broker URL must come from ASYNCFLOW_BROKER_URL: {url}"
    assert urlsplit(default.group(1)).hostname == "rabbitmq"
    for name in active(set()) - {"postgres", "migrate"}:
        assert SERVICES[name]["environment"]["ASYNCFLOW_BROKER_URL"] == url


def test_with_redis_nothing_waits_for_rabbitmq() -> None:
    for name in active({"redis"}):
        needs = SERVICES[name].get("depends_on", {})
        assert "rabbitmq" not in needs or needs["rabbitmq"].get("required") is False, name


def one_shot() -> set[str]:
    """Services others wait to have completed (a migration): they exit, so no healthcheck."""
    return {
        target
        for s in SERVICES.values()
        for target, how in (s.get("depends_on") or {}).items()
        if isinstance(how, dict) and how.get("condition") == "service_completed_successfully"
    }


@pytest.mark.parametrize("name", list(SERVICES))
def test_every_long_running_service_has_a_healthcheck(name: str) -> None:
    if name in one_shot():
        assert "restart" not in SERVICES[name]
        return
    check = SERVICES[name].get("healthcheck")
    assert check and check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def published(service: dict[str, Any]) -> list[int]:
    ports = []
    for spec in service.get("ports", []):
        container = str(spec["target"] if isinstance(spec, dict) else spec).rsplit(":", 1)[-1]
        ports.append(int(container.split("/")[0]))
    return ports


def test_no_broker_or_management_port_is_published() -> None:
    assert not SERVICES["rabbitmq"].get("ports") and not SERVICES["redis"].get("ports")
    for name, service in SERVICES.items():
        assert 15672 not in published(service), f"{name} publishes RabbitMQ's management UI"


def test_monitoring_ports_are_published_on_localhost_only() -> None:
    for name in ("prometheus", "grafana"):
        for spec in SERVICES[name].get("ports", []):
            assert str(spec).startswith("127.0.0.1:"), f"{name} publishes {spec} beyond this host"


@pytest.mark.parametrize("name", list(SERVICES))
def test_mounted_files_exist(name: str) -> None:
    for volume in SERVICES[name].get("volumes", []):
        source = str(volume).split(":", 1)[0]
        if source.startswith("."):
            assert (REPO / source).exists(), f"{name} mounts {source}, which is not in the repository"
    build = SERVICES[name].get("build")
    if build:
        assert (REPO / build / "Dockerfile").exists()


def test_prometheus_scrapes_the_api_metrics() -> None:
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in SERVICES and f"--port {port}" in " ".join(SERVICES[host]["command"])


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())

    def walk(panels: list[dict[str, Any]]) -> Iterator[str]:
        for panel in panels:
            yield from (t["expr"] for t in panel.get("targets", []))
            yield from walk(panel.get("panels", []))

    return list(walk(doc["panels"]))


def metric_of(name: str) -> str:
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base if base in HISTOGRAMS else name


def test_dashboard_queries_only_known_metrics_and_shows_them_all() -> None:
    queried = {metric_of(n) for expr in dashboard_exprs() for n in re.findall(r"\basyncflow_\w+", expr)}
    assert queried <= METRICS, f"unknown metrics: {sorted(queried - METRICS)}"
    assert queried == METRICS, f"not shown: {sorted(METRICS - queried)}"


def test_histograms_are_read_as_quantiles_by_module_and_command() -> None:
    exprs = dashboard_exprs()
    step = [e for e in exprs if "asyncflow_step_seconds_bucket" in e]
    assert {q for e in step for q in re.findall(r"histogram_quantile\((0\.\d+)", e)} == {"0.5", "0.99"}
    assert all("module" in e and "command" in e for e in step)


def test_dashboard_uses_the_provisioned_datasource() -> None:
    sources = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in sources["datasources"]}
    doc = json.loads(DASHBOARD.read_text())
    used = {p["datasource"]["uid"] for p in doc["panels"] if "datasource" in p}
    assert used and used <= uids
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/asyncflow.yml").read_text())
    mounts = dict(str(v).split(":")[:2] for v in SERVICES["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
