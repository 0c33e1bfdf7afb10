"""flows.yaml: the shipped file loads; every error names the file, the flow and the field."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from asyncflow.cli import main
from shared.flows import FlowsError, load_flows

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
REPO_FLOWS = ROOT / "flows.yaml"
EXAMPLE_MODULES = [ROOT / "modules" / f"{name}.py" for name in ("resource", "mysql", "monitor")]


@pytest.fixture
def testmod_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SUPPORT))


def support_flows() -> dict[str, Any]:
    """tests/support/flows.yaml with only the testmod modules (alpha, beta)."""
    data = yaml.safe_load((SUPPORT / "flows.yaml").read_text(encoding="utf-8"))
    del data["modules"]["monitor"]  # declared there but used by no step; keep these tests to testmod
    return data


def write(tmp_path: Path, data: Any, name: str = "flows.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def variant(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    data = copy.deepcopy(support_flows())
    change(data)
    return write(tmp_path, data)


def problems_of(path: Path, check_commands: bool = False) -> list[str]:
    with pytest.raises(FlowsError) as info:
        load_flows(path, check_commands=check_commands)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


# --- the shipped flows.yaml -----------------------------------------------------------


def test_repo_flows_yaml_loads() -> None:
    flows = load_flows(REPO_FLOWS)
    assert flows.source == str(REPO_FLOWS)
    assert {"create_mysql_instance", "delete_mysql_instance"} <= set(flows.flows)
    create = flows.flows["create_mysql_instance"]
    # The seed's example (SPEC §7): three steps with these commands and compensations.
    assert [(s.normal.module, s.normal.command) for s in create.steps] == [
        ("resource", "check_resource"),
        ("mysql", "init_instance"),
        ("resource", "deduct_resource"),
    ]
    assert [(s.rollback.module, s.rollback.command) for s in create.steps if s.rollback] == [
        ("monitor", "report_event"),
        ("mysql", "clean_instance"),
        ("resource", "restore_resource"),
    ]
    assert {"resource", "mysql", "monitor"} <= flows.module_names()


@pytest.mark.skipif(
    not all(p.exists() for p in EXAMPLE_MODULES), reason="the example modules are not written yet"
)
def test_repo_flows_yaml_commands_exist_in_the_example_modules() -> None:
    load_flows(REPO_FLOWS, check_commands=True)
    result = CliRunner().invoke(main, ["flows", "check", str(REPO_FLOWS)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.stdout


def test_support_flows_load_with_their_commands(testmod_on_path: None, tmp_path: Path) -> None:
    flows = load_flows(write(tmp_path, support_flows()), check_commands=True)
    three = flows.flows["three"]
    assert len(three.steps) == 3
    assert three.steps[0].rollback is not None and three.steps[0].rollback.max_retry_interval == -0.2
    assert flows.import_path("alpha") == "testmod"
    assert flows.import_path("undeclared") == "modules.undeclared"


# --- each kind of error ------------------------------------------------------------------


def _set(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _delete(*path: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return change


STEPS = ("flows", "three", "steps")

ERRORS = {
    "unknown key in a command": (
        _set(*STEPS, 0, "normal", "retires", value=3),
        "flow 'three': steps[0].normal.retires: ",
        "Extra inputs are not permitted",
    ),
    "unknown key in a step": (
        _set(*STEPS, 1, "compensate", value={"module": "beta", "command": "undo"}),
        "flow 'three': steps[1].compensate: ",
        "Extra inputs are not permitted",
    ),
    "unknown key in a flow": (
        _set("flows", "noop", "stepz", value=[]),
        "flow 'noop': stepz: ",
        "Extra inputs are not permitted",
    ),
    "missing normal": (
        _delete(*STEPS, 1, "normal"),
        "flow 'three': steps[1].normal: ",
        "Field required",
    ),
    "missing command": (
        _delete(*STEPS, 2, "rollback", "command"),
        "flow 'three': steps[2].rollback.command: ",
        "Field required",
    ),
    "negative retry": (
        _set(*STEPS, 1, "normal", "retry", value=-1),
        "flow 'three': steps[1].normal.retry: ",
        "greater than or equal to 0",
    ),
    "timeout 0": (
        _set(*STEPS, 2, "rollback", "timeout", value=0),
        "flow 'three': steps[2].rollback.timeout: ",
        "greater than 0",
    ),
    "timeout not a number": (
        _set(*STEPS, 0, "normal", "timeout", value="soon"),
        "flow 'three': steps[0].normal.timeout: ",
        "valid number",
    ),
    "bad module name": (
        _set(*STEPS, 0, "normal", "module", value="my-module"),
        "flow 'three': steps[0].normal.module: ",
        "should match pattern",
    ),
    "bad command name": (
        _set(*STEPS, 1, "rollback", "command", value="undo all"),
        "flow 'three': steps[1].rollback.command: ",
        "should match pattern",
    ),
    "empty steps": (
        _set("flows", "noop", "steps", value=[]),
        "flow 'noop': steps: ",
        "at least 1 item",
    ),
    "steps not a list": (
        _set("flows", "noop", "steps", value="alpha.step"),
        "flow 'noop': steps: ",
        "valid list",
    ),
    "bad flow name": (
        _set("flows", "bad-name", value={"steps": [{"normal": {"module": "alpha", "command": "step"}}]}),
        "flow 'bad-name': ",
        "name must match",
    ),
    "missing flows key": (
        _delete("flows"),
        "flows: ",
        "Field required",
    ),
    "unknown top-level key": (
        _set("flow", value={}),
        "flow: ",
        "Extra inputs are not permitted",
    ),
    "retry_interval of earlier releases": (
        _set(*STEPS, 0, "normal", "retry_interval", value=5),
        "flow 'three': steps[0].normal: ",
        "uniform retries every S seconds are max_retry_interval: -S",
    ),
    "unknown module mode": (
        _set("modules", "alpha", "mode", value="pull-ish"),
        "module 'alpha': mode: ",
        "Input should be 'push'",
    ),
}


@pytest.mark.parametrize("change, where, what", ERRORS.values(), ids=list(ERRORS))
def test_each_error_names_the_file_the_flow_and_the_field(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], where: str, what: str
) -> None:
    path = variant(tmp_path, change)
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}: {where}"), problem
    assert what in problem, problem


@pytest.mark.parametrize(
    "text",
    ["- just\n- a list\n", "a plain string\n", "42\n", "", "# only a comment\n"],
    ids=["list", "string", "number", "empty", "comment-only"],
)
def test_a_top_level_that_is_not_a_mapping_is_reported(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    assert problems_of(path) == [f"{path}: top level must be a mapping with a 'flows' key"]


def test_invalid_yaml_is_reported_with_its_position(tmp_path: Path) -> None:
    path = write(tmp_path, "flows:\n  three:\n    steps: [unclosed\n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}: not valid YAML: "), problem
    assert "line" in problem, problem


def test_a_missing_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "flows.yaml"
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}: cannot read: "), problem
    assert "No such file" in problem, problem


def test_several_errors_are_reported_together(tmp_path: Path) -> None:
    def change(data: dict[str, Any]) -> None:
        _set(*STEPS, 1, "normal", "retry", value=-2)(data)
        _set(*STEPS, 2, "normal", "timeout", value=0)(data)
        _set("flows", "noop", "steps", value=[])(data)
        _set(*STEPS, 0, "rollback", "colour", value="red")(data)
        _set("flows", "bad-name", value={"steps": [{"normal": {"module": "alpha", "command": "step"}}]})(data)

    path = variant(tmp_path, change)
    problems = problems_of(path)
    assert len(problems) == 5, problems
    expected = [
        f"{path}: flow 'bad-name': name must match ",
        f"{path}: flow 'three': steps[0].rollback.colour: ",
        f"{path}: flow 'three': steps[1].normal.retry: ",
        f"{path}: flow 'three': steps[2].normal.timeout: ",
        f"{path}: flow 'noop': steps: ",
    ]
    for prefix in expected:
        assert [p for p in problems if p.startswith(prefix)], (prefix, problems)


# --- module commands (check_commands) ------------------------------------------------------


def test_an_unknown_command_is_reported_with_the_commands_the_module_has(
    testmod_on_path: None, tmp_path: Path
) -> None:
    path = variant(tmp_path, _set(*STEPS, 2, "rollback", "command", value="undo_all"))
    load_flows(path)  # the shape is valid: commands are only checked on request
    assert problems_of(path, check_commands=True) == [
        f"{path}: flow 'three': steps[2].rollback.command: "
        "module 'alpha' has no command 'undo_all' (it has: step, undo)"
    ]


def test_every_unknown_command_is_reported(testmod_on_path: None, tmp_path: Path) -> None:
    def change(data: dict[str, Any]) -> None:
        _set(*STEPS, 0, "normal", "command", value="stpe")(data)
        _set("flows", "noop", "steps", 1, "normal", "command", value="nope")(data)

    path = variant(tmp_path, change)
    problems = problems_of(path, check_commands=True)
    assert sorted(problems) == sorted([
        f"{path}: flow 'three': steps[0].normal.command: "
        "module 'alpha' has no command 'stpe' (it has: step, undo)",
        f"{path}: flow 'noop': steps[1].normal.command: "
        "module 'beta' has no command 'nope' (it has: step, undo)",
    ])


def test_an_import_path_that_does_not_exist_is_reported(testmod_on_path: None, tmp_path: Path) -> None:
    path = variant(tmp_path, _set("modules", "beta", "import", value="testmod_gone"))
    (problem,) = problems_of(path, check_commands=True)
    assert problem.startswith(f"{path}: module 'beta': cannot import 'testmod_gone'"), problem


def test_an_undeclared_module_is_imported_from_modules_package(testmod_on_path: None, tmp_path: Path) -> None:
    path = variant(tmp_path, _set(*STEPS, 1, "normal", "module", value="gamma_nowhere"))
    (problem,) = problems_of(path, check_commands=True)
    assert problem.startswith(f"{path}: module 'gamma_nowhere': cannot import 'modules.gamma_nowhere'"), problem


def test_an_import_path_without_that_module_is_reported(testmod_on_path: None, tmp_path: Path) -> None:
    path = variant(tmp_path, _set("modules", "alpha", "import", value="json"))
    (problem,) = problems_of(path, check_commands=True)
    assert problem == f"{path}: module 'alpha': 'json' defines no Module('alpha')"


# --- pull-mode modules ------------------------------------------------------------------------


def test_pull_flows_load_and_the_pull_module_is_not_imported(testmod_on_path: None) -> None:
    flows = load_flows(SUPPORT / "pull_flows.yaml", check_commands=True)
    assert set(flows.pull_modules()) == {"dns"}
    assert flows.pull_modules()["dns"].poll_interval == 0.3
    assert flows.push_module_names() == {"alpha", "beta"}
    assert flows.module_names() == {"alpha", "beta", "dns"}


def test_a_pull_module_cannot_be_run_by_a_celery_worker(testmod_on_path: None) -> None:
    flows = load_flows(SUPPORT / "pull_flows.yaml")
    with pytest.raises(FlowsError) as info:
        flows.check_commands(only=["alpha", "dns"])
    (problem,) = info.value.problems
    assert "module 'dns' is pull-mode" in problem and "/v1/hold_tasks" in problem


@pytest.mark.parametrize(
    ("decl", "expected"),
    [
        ({"mode": "pull", "import": "testmod"}, "modules.dns: a pull-mode module has no Python code to import"),
        ({"import": "testmod", "poll_interval": 2}, "poll_interval: only for mode: pull"),
        ({"mode": "pull", "poll_interval": 0}, "module 'dns': poll_interval: Input should be greater than 0"),
        ({"mode": "queue"}, "module 'dns': mode: Input should be 'push' or 'pull'"),
        ({"mode": "pull", "release_ahead": 10}, "release_ahead: only for mode: push"),
        ({"import": "testmod", "release_ahead": 1}, "module 'dns': release_ahead: Input should be greater than or equal to 2"),
    ],
)
def test_pull_mode_declarations_are_checked(tmp_path: Path, decl: dict[str, Any], expected: str) -> None:
    data = yaml.safe_load((SUPPORT / "pull_flows.yaml").read_text(encoding="utf-8"))
    data["modules"]["dns"] = decl
    (problem,) = problems_of(write(tmp_path, data))
    assert expected.split(": ", 1)[-1] in problem, problem
    assert "'dns'" in problem, problem


# --- CLI: asyncflow flows check -----------------------------------------------------------------


def test_cli_check_accepts_a_good_file(testmod_on_path: None, tmp_path: Path) -> None:
    path = write(tmp_path, support_flows())
    result = CliRunner().invoke(main, ["flows", "check", str(path)])
    assert result.exit_code == 0, result.output
    names = sorted(support_flows()["flows"])
    assert result.stdout.strip() == f"{path}: {len(names)} flows OK ({', '.join(names)})"
    assert result.stderr == ""


def test_cli_validate_is_the_old_name_of_check(testmod_on_path: None, tmp_path: Path) -> None:
    path = variant(tmp_path, _set(*STEPS, 0, "normal", "command", value="missing"))
    result = CliRunner().invoke(main, ["flows", "validate", str(path)])
    assert result.exit_code == 1, result.output
    assert "module 'alpha' has no command 'missing'" in result.stderr
    assert "validate" not in CliRunner().invoke(main, ["flows", "--help"]).output


def test_cli_check_reports_each_problem_on_stderr_and_exits_1(testmod_on_path: None, tmp_path: Path) -> None:
    def change(data: dict[str, Any]) -> None:
        _set(*STEPS, 1, "normal", "retry", value=-1)(data)
        _set("flows", "noop", "steps", value=[])(data)

    path = variant(tmp_path, change)
    result = CliRunner().invoke(main, ["flows", "check", str(path)])
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 2, lines
    assert any(line.startswith(f"{path}: flow 'three': steps[1].normal.retry: ") for line in lines), lines
    assert any(line.startswith(f"{path}: flow 'noop': steps: ") for line in lines), lines
    assert "OK" not in result.stdout


def test_cli_check_checks_module_commands(testmod_on_path: None, tmp_path: Path) -> None:
    path = variant(tmp_path, _set(*STEPS, 0, "normal", "command", value="missing"))
    result = CliRunner().invoke(main, ["flows", "check", str(path)])
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        f"{path}: flow 'three': steps[0].normal.command: "
        "module 'alpha' has no command 'missing' (it has: step, undo)"
    ]


def test_cli_check_reports_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    result = CliRunner().invoke(main, ["flows", "check", str(path)])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"{path}: cannot read: ")


def test_cli_check_defaults_to_asyncflow_flows(
    testmod_on_path: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, support_flows(), name="custom.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ASYNCFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ASYNCFLOW_FLOWS", str(path))
    result = CliRunner().invoke(main, ["flows", "check"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{path}: {len(support_flows()['flows'])} flows OK")


def test_a_users_package_beside_flows_yaml_imports_without_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "acme_billing_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "billing.py").write_text(
        "from shared.module import Module\n"
        "module = Module('billing')\n"
        "module.command('charge')(lambda ctx: {'Charged': True})\n"
    )
    flows = tmp_path / "flows.yaml"
    flows.write_text(
        "modules:\n  billing: {import: acme_billing_pkg.billing}\n"
        "flows:\n  pay:\n    steps:\n      - normal: {module: billing, command: charge}\n"
    )
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "acme_billing_pkg", raising=False)
    monkeypatch.delitem(sys.modules, "acme_billing_pkg.billing", raising=False)
    modules = load_flows(flows).check_commands()
    assert modules["billing"].handler("charge") is not None
