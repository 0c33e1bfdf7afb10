"""Parameters declared in flows.yaml: the schema checked at load, the values at submit, reloads.

Through the real app over an in-memory runtime (``shared.testing.InProcess``): a
422 names each parameter and nothing is stored or published.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from asyncflow.cli import main
from oss_api.testing import TestClient, open_client
from shared import reload
from shared.config import Settings
from shared.flows import FlowsError, load_flows, parse_flows
from shared.parameters import InvalidParameters
from shared.storage import TaskFilter
from shared.testing import InProcess

SIZED = {
    "type": "object",
    "required": ["Cpu"],
    "properties": {
        "Cpu": {"type": "integer", "minimum": 1, "maximum": 64},
        "Tier": {"enum": ["gold", "silver"], "default": "silver"},
        "Name": {"type": "string", "pattern": "^[a-z]+$"},
        "Labels": {"type": "object", "properties": {"team": {"type": "string", "default": "core"}}},
    },
}
STEP = {"normal": {"module": "alpha", "command": "step", "timeout": 20}}


def flows_doc(**parameters: Any) -> dict[str, Any]:
    """A flows.yaml with ``noop`` (no declaration) and ``sized`` (declaring ``parameters``, default SIZED)."""
    return {
        "modules": {"alpha": {"import": "testmod"}},
        "flows": {
            "noop": {"steps": [STEP]},
            "sized": {"steps": [STEP], "parameters": parameters.get("parameters", SIZED)},
        },
    }


def problems(data: Any) -> list[str]:
    with pytest.raises(FlowsError) as info:
        parse_flows(data, "f.yaml")
    return info.value.problems


def write(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


# --- the declaration, when flows.yaml loads --------------------------------------------------


@pytest.mark.parametrize(
    "schema, field, problem",
    [
        ({"properties": {"Cpu": {"type": "integr"}}}, "parameters.properties.Cpu.type", "is not one of ['array'"),
        ({"properties": {"Cpu": {"minimum": "one"}}}, "parameters.properties.Cpu.minimum", "is not of type 'number'"),
        ({"required": "Cpu"}, "parameters.required", "is not of type 'array'"),
        ({"properties": {"N": {"pattern": "("}}}, "parameters.properties.N.pattern", "is not a 'regex'"),
        ({"type": "array"}, "parameters.type", "must be object"),
        ({"properties": {"Cpu": {"type": "integer", "default": "two"}}}, "parameters.properties.Cpu.default",
         "'two' is not of type 'integer'"),
        ({"properties": {"Cpu": {"$ref": "#/$defs/Count"}}}, "parameters.properties.Cpu.$ref", "cannot be resolved"),
        ({"properties": {"Cpu": {"$ref": "https://example.com/cpu.json"}}}, "parameters.properties.Cpu.$ref",
         "cannot be resolved"),
    ],
)
def test_a_bad_declaration_names_the_file_the_flow_and_the_field(schema: Any, field: str, problem: str) -> None:
    (line,) = problems(flows_doc(parameters=schema))
    assert line.startswith(f"f.yaml: flow 'sized': {field}: "), line
    assert problem in line, line


def test_a_declaration_must_be_a_mapping_of_json() -> None:
    (line,) = problems(flows_doc(parameters=["Cpu"]))
    assert line.startswith("f.yaml: flow 'sized': parameters: "), line
    # YAML reads an unquoted date as a date, which no task parameter can hold.
    dated = yaml.safe_load("properties: {Day: {type: string, default: 2024-01-01}}")
    (line,) = problems(flows_doc(parameters=dated))
    assert line.startswith("f.yaml: flow 'sized': parameters: must be JSON (quote dates in YAML)"), line


def test_problems_of_several_flows_are_reported_together() -> None:
    data = flows_doc(parameters={"type": "string"})
    data["flows"]["noop"]["parameters"] = {"properties": {"X": {"type": "nothing"}}}
    assert [line.split(":")[1] for line in problems(data)] == [" flow 'noop'", " flow 'sized'"]


def test_references_inside_the_schema_and_formats_are_followed() -> None:
    schema = {
        "properties": {"Cpu": {"$ref": "#/$defs/Count"}, "Contact": {"type": "string", "format": "email"}},
        "$defs": {"Count": {"type": "integer", "minimum": 1}},
    }
    flow = parse_flows(flows_doc(parameters=schema)).flows["sized"]
    with pytest.raises(InvalidParameters) as info:
        flow.check_parameters({"Cpu": 0, "Contact": "nobody"})
    assert [d["field"] for d in info.value.detail] == ["parameters.Contact", "parameters.Cpu"]


def test_schedules_in_the_file_are_checked_against_their_flow() -> None:
    data = flows_doc()
    data["schedules"] = {"hourly": {"flow": "sized", "parameters": {"Cpu": "four"}, "every": 3600}}
    (line,) = problems(data)
    assert line == "f.yaml: schedule 'hourly': parameters.Cpu: 'four' is not of type 'integer'"
    data["schedules"]["hourly"]["parameters"] = {"Cpu": 4}
    assert parse_flows(data).schedules["hourly"].parameters == {"Cpu": 4}  # defaults are filled at each firing


def test_the_shipped_example_flows_declare_what_their_modules_read() -> None:
    flows = load_flows(Path(__file__).resolve().parents[2] / "flows.yaml")
    create = flows.flows["create_mysql_instance"]
    good = {"Cpu": 4, "Memory": 8, "Storage": 500, "Name": "orders", "FailCommands": ["deduct_resource"]}
    assert create.check_parameters(good) == good
    with pytest.raises(InvalidParameters) as info:
        create.check_parameters({"Cpu": "four", "Memory": 8, "Storage": 0})
    assert info.value.problems == [
        ("parameters.Cpu", "'four' is not of type 'integer'"),
        ("parameters.Storage", "0 is less than the minimum of 1"),
    ]
    with pytest.raises(InvalidParameters, match="parameters.InstanceName: is required"):
        flows.flows["delete_mysql_instance"].check_parameters({})


# --- the values, at submit ---------------------------------------------------------------------


def test_defaults_of_top_level_properties_are_filled_in_and_not_shared() -> None:
    flow = parse_flows(flows_doc()).flows["sized"]
    first = flow.check_parameters({"Cpu": 2, "Labels": {}})
    # Only top-level defaults: Labels.team is the module's business.
    assert first == {"Cpu": 2, "Tier": "silver", "Labels": {}}
    assert flow.check_parameters({"Cpu": 2, "Tier": "gold"})["Tier"] == "gold"
    schema = copy.deepcopy(SIZED)
    schema["properties"]["Tags"] = {"type": "array", "default": []}
    flow = parse_flows(flows_doc(parameters=schema)).flows["sized"]
    flow.check_parameters({"Cpu": 1})["Tags"].append("x")
    assert flow.check_parameters({"Cpu": 1})["Tags"] == []


def test_a_flow_without_a_declaration_takes_anything_as_it_is() -> None:
    flow = parse_flows(flows_doc()).flows["noop"]
    anything = {"Cpu": "four", "nested": {"a": [1, None]}}
    assert flow.parameters is None
    assert flow.check_parameters(anything) == anything


def test_every_problem_is_named_with_what_is_allowed() -> None:
    schema = copy.deepcopy(SIZED) | {"additionalProperties": False}
    flow = parse_flows(flows_doc(parameters=schema)).flows["sized"]
    with pytest.raises(InvalidParameters) as info:
        flow.check_parameters({"Tier": "bronze", "Name": "Bad Name", "Colour": "red", "Labels": {"team": 7}})
    assert info.value.status_code == 422
    assert info.value.problems == [
        ("parameters.Colour", "is not a parameter of this flow (declared: Cpu, Labels, Name, Tier)"),
        ("parameters.Cpu", "is required"),
        ("parameters.Labels.team", "7 is not of type 'string'"),
        ("parameters.Name", "'Bad Name' does not match '^[a-z]+$'"),
        ("parameters.Tier", "'bronze' is not one of ['gold', 'silver']"),
    ]
    assert str(info.value).startswith("invalid parameters for flow 'sized': parameters.Colour: is not a parameter")


def test_a_long_value_is_shortened_in_the_problem() -> None:
    flow = parse_flows(flows_doc()).flows["sized"]
    with pytest.raises(InvalidParameters) as info:
        flow.check_parameters({"Cpu": "x" * 10_000})
    ((field, problem),) = info.value.problems
    assert field == "parameters.Cpu" and problem.endswith("... is not of type 'integer'") and len(problem) < 200


@dataclass
class Api:
    client: TestClient
    app: InProcess

    def stored(self) -> list[dict[str, Any]]:
        return [dict(t.parameters) for t in self.app.runtime.store.list(TaskFilter(limit=100))]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    path = write(tmp_path / "flows.yaml", flows_doc())
    app = InProcess(load_flows(path), tmp_path, settings=Settings(home=tmp_path, flows=path))
    with open_client(app.runtime) as client:
        yield Api(client, app)


def test_submit_with_a_wrong_parameter_is_422_naming_it_and_stores_nothing(api: Api) -> None:
    r = api.client.post("/api/tasks", json={"flow": "sized", "parameters": {"Cpu": "four", "Tier": "bronze"}})
    assert r.status_code == 422, r.text
    assert r.json() == {
        "error": "invalid parameters for flow 'sized': parameters.Cpu: 'four' is not of type 'integer'; "
        "parameters.Tier: 'bronze' is not one of ['gold', 'silver']",
        "detail": [
            {"field": "parameters.Cpu", "problem": "'four' is not of type 'integer'"},
            {"field": "parameters.Tier", "problem": "'bronze' is not one of ['gold', 'silver']"},
        ],
    }
    assert api.stored() == []
    assert not api.app.publisher.messages


def test_submit_stores_the_defaults_and_undeclared_flows_are_unchanged(api: Api) -> None:
    r = api.client.post("/api/tasks", json={"flow": "sized", "parameters": {"Cpu": 2}})
    assert r.status_code == 201, r.text
    assert r.json()["parameters"] == {"Cpu": 2, "Tier": "silver"}
    r = api.client.post("/api/tasks", json={"flow": "noop", "parameters": {"Cpu": "four"}})
    assert r.status_code == 201, r.text
    stored = api.stored()
    assert len(stored) == 2 and {"Cpu": 2, "Tier": "silver"} in stored and {"Cpu": "four"} in stored
    declared = {f["name"]: f["parameters"] for f in api.client.get("/api/flows").json()["flows"]}
    assert declared == {"noop": None, "sized": SIZED}


def test_a_schedule_of_a_flow_is_422_on_parameters_the_flow_refuses(api: Api) -> None:
    r = api.client.post("/api/schedules", json={"flow": "sized", "parameters": {"Cpu": 0}, "every": 60})
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == [{"field": "parameters.Cpu", "problem": "0 is less than the minimum of 1"}]
    assert api.client.get("/api/schedules").json() == {"schedules": []}
    made = api.client.post("/api/schedules", json={"flow": "sized", "parameters": {"Cpu": 1}, "every": 60})
    assert made.status_code == 201, made.text
    changed = api.client.patch(f"/api/schedules/{made.json()['schedule_id']}", json={"parameters": {}})
    assert changed.status_code == 422, changed.text
    assert changed.json()["detail"] == [{"field": "parameters.Cpu", "problem": "is required"}]


# --- reloading -----------------------------------------------------------------------------------


def test_a_reload_puts_a_valid_file_in_use_and_refuses_an_invalid_one(api: Api, tmp_path: Path) -> None:
    runtime = api.app.runtime
    doc = flows_doc()
    doc["flows"]["added"] = {"steps": [STEP], "parameters": {"required": ["Day"]}}
    write(tmp_path / "flows.yaml", doc)
    assert reload.reload_flows(runtime)
    assert api.client.post("/api/tasks", json={"flow": "added", "parameters": {"Day": 1}}).status_code == 201
    assert api.client.post("/api/tasks", json={"flow": "added", "parameters": {}}).status_code == 422

    (tmp_path / "flows.yaml").write_text("flows: {added: {steps: []}}", encoding="utf-8")
    assert not reload.reload_flows(runtime)
    assert api.client.post("/api/tasks", json={"flow": "added", "parameters": {"Day": 2}}).status_code == 201
    assert set(runtime.flows.flows) == {"noop", "sized", "added"}


def test_a_reload_that_changes_pull_mode_modules_is_refused(api: Api, tmp_path: Path) -> None:
    doc = flows_doc()
    doc["modules"]["dns"] = {"mode": "pull"}
    doc["flows"]["records"] = {"steps": [{"normal": {"module": "dns", "command": "add"}}]}
    write(tmp_path / "flows.yaml", doc)
    with pytest.raises(FlowsError, match="pull-mode module\\(s\\) dns changed.*restart"):
        api.app.runtime.reload_flows()
    assert "records" not in api.app.runtime.flows.flows


def test_the_scheduler_applies_the_schedules_of_a_reloaded_file(api: Api, tmp_path: Path) -> None:
    doc = flows_doc()
    doc["schedules"] = {"hourly": {"flow": "sized", "parameters": {"Cpu": 3}, "every": 3600}}
    write(tmp_path / "flows.yaml", doc)
    assert reload.reload_flows(api.app.runtime, declare_schedules=True)
    (schedule,) = api.client.get("/api/schedules").json()["schedules"]
    assert (schedule["schedule_id"], schedule["parameters"]) == ("hourly", {"Cpu": 3})


def test_sighup_runs_the_reload_on_a_thread_of_its_own() -> None:
    before = signal.getsignal(signal.SIGHUP)
    ran = threading.Event()
    threads: list[str] = []

    def action() -> None:
        threads.append(threading.current_thread().name)
        ran.set()

    try:
        reload.on_hangup(action)
        assert reload.handles_hangup(os.getpid())
        os.kill(os.getpid(), signal.SIGHUP)
        assert ran.wait(10)
    finally:
        signal.signal(signal.SIGHUP, before)
    assert threads == ["sighup"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_handles_hangup_tells_a_process_that_sighup_would_end() -> None:
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not reload.handles_hangup(plain.pid, within=0.2)
    finally:
        plain.kill()
        plain.wait()


# --- the CLI ------------------------------------------------------------------------------------


def test_flows_reload_without_a_running_up_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFLOW_HOME", str(tmp_path))
    result = CliRunner().invoke(main, ["flows", "reload"])
    assert result.exit_code == 1
    assert f"no running `asyncflow up` found ({tmp_path / 'up.pid'})" in result.output


def test_flows_reload_refuses_an_invalid_file_and_signals_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "flows.yaml", flows_doc(parameters={"type": "string"}))
    monkeypatch.setenv("ASYNCFLOW_FLOWS", str(path))
    before = signal.getsignal(signal.SIGHUP)
    signalled = threading.Event()
    try:
        signal.signal(signal.SIGHUP, lambda *_: signalled.set())
        result = CliRunner().invoke(main, ["flows", "reload", "--pid", str(os.getpid())])
    finally:
        signal.signal(signal.SIGHUP, before)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"{path}: flow 'sized': parameters.type: must be object: "
                                          "a task's parameters are a mapping of names to values"]
    assert not signalled.is_set()


def test_flows_reload_signals_the_process_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "flows.yaml", flows_doc())
    monkeypatch.setenv("ASYNCFLOW_FLOWS", str(path))
    before = signal.getsignal(signal.SIGHUP)
    signalled = threading.Event()
    try:
        signal.signal(signal.SIGHUP, lambda *_: signalled.set())
        result = CliRunner().invoke(main, ["flows", "reload", "--pid", str(os.getpid())])
        assert signalled.wait(10)
    finally:
        signal.signal(signal.SIGHUP, before)
    assert result.exit_code == 0, result.output
    assert result.output == f"process {os.getpid()} signalled to reload {path}\n"


def test_the_reload_log_names_each_problem(api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write(tmp_path / "flows.yaml", flows_doc(parameters={"properties": {"Cpu": {"type": "integr"}}}))
    with caplog.at_level(logging.ERROR, logger="shared.reload"):
        assert not reload.reload_flows(api.app.runtime)
    (record,) = caplog.records
    assert "flows.yaml not reloaded, the flows loaded before stay in use" in record.getMessage()
    assert "flow 'sized': parameters.properties.Cpu.type" in record.getMessage()
