"""flows.yaml: loaded into pydantic models and validated once, at start-up.

    modules:                       # optional: where each module's code lives
      resource: {import: modules.resource}
    flows:
      create_mysql_instance:
        description: ...
        steps:
          - normal:   {module: resource, command: check_resource, timeout: 300, retry: 0}
            rollback: {module: monitor, command: report_event, timeout: 300, retry: 3}
        parameters:                # optional: a JSON Schema of the submit parameters
          type: object
          required: [Cpu]
          properties: {Cpu: {type: integer, minimum: 1}}

A module without an entry is imported from ``modules.<name>``. Every error names
the file, the flow and the field. A flow without ``parameters`` takes any.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.module import Module, ModuleError, import_module_object
from shared.names import NAME
from shared.parameters import InvalidParameters, checked, schema_problems
from shared.schedules.definition import SCHEDULE_ID, Definition


class FlowsError(Exception):
    """flows.yaml cannot be used; ``problems`` holds one line per error."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class Action(BaseModel):
    """One command of a step, with its time limit and retry policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    module: str = Field(pattern=NAME)
    command: str = Field(pattern=NAME)
    timeout: float = Field(default=300, gt=0, le=7 * 24 * 3600)
    retry: int = Field(default=0, ge=0, le=100)
    # The seed's retry rule (shared.retry): -1 is a uniform retry every second.
    max_retry_interval: float = Field(default=-1, ge=-24 * 3600, le=24 * 3600)

    @model_validator(mode="before")
    @classmethod
    def _no_retry_interval(cls, data: Any) -> Any:
        if isinstance(data, dict) and "retry_interval" in data:
            raise ValueError(
                "retry_interval is no longer a field: uniform retries every S seconds are "
                "max_retry_interval: -S (see shared/retry.py)"
            )
        return data


class StepDef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    normal: Action
    rollback: Action | None = None


class Flow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME)
    description: str = ""
    steps: tuple[StepDef, ...] = Field(min_length=1, max_length=200)
    # A JSON Schema of the submit parameters (checked by parse_flows), or None: any are taken.
    parameters: dict[str, Any] | None = None

    def check_parameters(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` as a new task of this flow takes them: the declared defaults filled in.

        Raises :class:`shared.parameters.InvalidParameters` naming each parameter
        the declaration refuses. A flow that declares none takes ``values`` as they are.
        """
        if self.parameters is None:
            return dict(values)
        return checked(self.parameters, values, self.name)

    def actions(self) -> Iterable[tuple[int, str, Action]]:
        for i, step in enumerate(self.steps):
            yield i, "normal", step.normal
            if step.rollback is not None:
                yield i, "rollback", step.rollback


class ModuleDecl(BaseModel):
    """How a module's steps reach their code.

    push (default): Celery workers that import ``import`` consume the module's queue.
    pull: external workers, in any language, lease the steps through the v1 API
    (hold_tasks / set_task with task_type = the module name); the settings below
    are that task type's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    import_path: str | None = Field(default=None, alias="import")
    mode: Literal["push", "pull"] = "push"
    schedule_limit: int = Field(default=100, ge=1, le=1000)  # steps per hold_tasks
    schedule_interval: int = Field(default=1, ge=0, le=3600)  # seconds between a worker's polls
    # A worker's set_task with status 1 means "not finished": lease it again after this.
    poll_interval: float = Field(default=5.0, gt=0, le=24 * 3600)
    # push: how many messages its queue may hold waiting before a batch's first steps wait
    # in the database instead; unset, ASYNCFLOW_RELEASE_AHEAD. A module whose steps are slow
    # takes fewer, so that none waits in its queue long enough to be published again.
    release_ahead: int | None = Field(default=None, ge=2)

    @model_validator(mode="after")
    def _fields_of_its_mode(self) -> ModuleDecl:
        if self.mode == "pull" and self.import_path is not None:
            raise ValueError("a pull-mode module has no Python code to import; remove 'import'")
        pull_only = {"schedule_limit", "schedule_interval", "poll_interval"} & self.model_fields_set
        if self.mode == "push" and pull_only:
            raise ValueError(f"{', '.join(sorted(pull_only))}: only for mode: pull")
        if self.mode == "pull" and "release_ahead" in self.model_fields_set:
            raise ValueError("release_ahead: only for mode: push (a pull-mode module has no queue)")
        return self


class _FlowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    steps: list[StepDef] = Field(min_length=1, max_length=200)
    parameters: dict[str, Any] | None = None


class _FlowsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modules: dict[str, ModuleDecl] = Field(default_factory=dict)
    flows: dict[str, _FlowBody]
    # By schedule id; the scheduler adds them at start, or updates those that changed.
    schedules: dict[str, Definition] = Field(default_factory=dict)


class FlowSet:
    """The validated content of one flows.yaml."""

    def __init__(
        self,
        flows: dict[str, Flow],
        modules: dict[str, ModuleDecl],
        source: str,
        schedules: dict[str, Definition] | None = None,
    ) -> None:
        self.flows = flows
        self.modules = modules
        self.source = source
        self.schedules = schedules or {}

    def get(self, name: str) -> Flow | None:
        return self.flows.get(name)

    def module_names(self) -> set[str]:
        names = set(self.modules)
        for flow in self.flows.values():
            names.update(action.module for _, _, action in flow.actions())
        return names

    def pull_modules(self) -> dict[str, ModuleDecl]:
        """Modules whose steps external workers lease through the v1 API."""
        return {name: decl for name, decl in self.modules.items() if decl.mode == "pull"}

    def push_module_names(self) -> set[str]:
        """Modules run by Celery workers (``asyncflow worker``)."""
        return self.module_names() - set(self.pull_modules())

    def import_path(self, module: str) -> str:
        decl = self.modules.get(module)
        return decl.import_path if decl and decl.import_path else f"modules.{module}"

    def load_module(self, name: str) -> Module:
        _importable_beside(self.source)
        return import_module_object(self.import_path(name), name)

    def check_commands(self, only: Iterable[str] | None = None) -> dict[str, Module]:
        """Import the modules (all, or ``only``) and check each provides the commands used.

        Returns the loaded modules; raises FlowsError listing every problem.
        """
        problems: list[str] = []
        loaded: dict[str, Module | None] = {}
        pull = set(self.pull_modules())
        for name in sorted(self.push_module_names() if only is None else set(only)):
            if name in pull:
                problems.append(
                    f"{self.source}: module {name!r} is pull-mode: external workers lease its steps "
                    "through /v1/hold_tasks; no Celery worker runs it"
                )
                continue
            try:
                loaded[name] = self.load_module(name)
            except ModuleError as exc:
                loaded[name] = None
                problems.append(f"{self.source}: {exc}")
        for flow in self.flows.values():
            for i, kind, action in flow.actions():
                module = loaded.get(action.module)  # None for pull-mode: any command goes
                if module is not None and action.command not in module.commands:
                    known = ", ".join(sorted(module.commands)) or "none"
                    problems.append(
                        f"{self.source}: flow {flow.name!r}: steps[{i}].{kind}.command: "
                        f"module {action.module!r} has no command {action.command!r} (it has: {known})"
                    )
        if problems:
            raise FlowsError(problems)
        return {name: module for name, module in loaded.items() if module is not None}


def _importable_beside(source: str) -> None:
    """Let modules kept beside flows.yaml (a user's own package) import without PYTHONPATH."""
    folder = Path(source).resolve().parent
    if Path(source).is_file() and str(folder) not in sys.path:
        sys.path.append(str(folder))


def _location(source: str, loc: tuple[Any, ...]) -> str:
    if len(loc) >= 2 and loc[0] == "flows":
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[2:]).lstrip(".")
        return f"{source}: flow {loc[1]!r}: {field or '(flow)'}"
    if len(loc) >= 2 and loc[0] in ("modules", "schedules"):
        rest = ".".join(str(p) for p in loc[2:])
        return f"{source}: {loc[0][:-1]} {loc[1]!r}: {rest or '(' + loc[0][:-1] + ')'}"
    return f"{source}: {'.'.join(str(p) for p in loc) or '(top level)'}"


def parse_flows(data: Any, source: str = "flows.yaml") -> FlowSet:
    if not isinstance(data, dict):
        raise FlowsError([f"{source}: top level must be a mapping with a 'flows' key"])
    # Names are checked before the bodies so that both kinds of error are reported together.
    names = data.get("flows")
    problems = [
        f"{source}: flow {name!r}: name must match {NAME}"
        for name in (names if isinstance(names, dict) else {})
        if isinstance(name, str) and re.fullmatch(NAME, name) is None
    ]
    try:
        parsed = _FlowsFile.model_validate(data)
    except ValidationError as exc:
        raise FlowsError(
            problems + [f"{_location(source, tuple(e['loc']))}: {e['msg']}" for e in exc.errors()]
        ) from exc
    if problems:
        raise FlowsError(problems)
    flows = {
        name: Flow(name=name, description=body.description, steps=tuple(body.steps), parameters=body.parameters)
        for name, body in parsed.flows.items()
    }
    for name, flow in flows.items():
        if flow.parameters is not None:
            problems += [
                f"{source}: flow {name!r}: {'.'.join(filter(None, ('parameters', field)))}: {problem}"
                for field, problem in schema_problems(flow.parameters)
            ]
    if problems:
        raise FlowsError(problems)
    schedules = {}
    for schedule_id, definition in parsed.schedules.items():
        where = f"{source}: schedule {schedule_id!r}"
        if re.fullmatch(SCHEDULE_ID, schedule_id) is None:
            problems.append(f"{where}: id must match {SCHEDULE_ID}")
        if definition.schedule_id not in (None, schedule_id):
            problems.append(f"{where}: schedule_id: differs from the key; leave it out")
        if definition.flow is not None and definition.flow not in flows:
            problems.append(f"{where}: flow: no flow {definition.flow!r} in this file")
        elif definition.flow is not None:
            try:
                flows[definition.flow].check_parameters(definition.parameters or {})
            except InvalidParameters as exc:
                problems += [f"{where}: {field}: {problem}" for field, problem in exc.problems]
        problems += [f"{where}: {field}: {problem}" for field, problem in definition.problems()]
        schedules[schedule_id] = definition.model_copy(update={"schedule_id": schedule_id})
    if problems:
        raise FlowsError(problems)
    return FlowSet(flows, parsed.modules, source, schedules)


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: a second flow of the same name
    would otherwise silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                # What SafeLoader says too, but before `key in seen` fails with a TypeError.
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, "found unhashable key", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_flows(path: Path | str, check_commands: bool = False) -> FlowSet:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise FlowsError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    flows = parse_flows_file(raw, str(path))
    if check_commands:
        flows.check_commands()
    return flows


def parse_flows_file(raw: bytes, source: str) -> FlowSet:
    """The flows of a flows.yaml's bytes; ``source`` names the file in the problems."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FlowsError([f"{source}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from exc
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise FlowsError([f"{source}: not valid YAML: {exc}"]) from exc
    except RecursionError:
        # PyYAML builds nested collections recursively.
        raise FlowsError([f"{source}: not valid YAML: nested too deeply"]) from None
    return parse_flows(data, source)
