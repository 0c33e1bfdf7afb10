"""The TaskStore contract, written once and run on every backend.

SQLite (a file migrated with Alembic), PostgreSQL (a fresh migrated schema per
run; marked ``postgres``) and the shipped InMemoryStore fake must behave the same.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from shared.flows import Action, Flow, StepDef
from shared.saga import Submit, decide
from shared.states import Phase, StepCode, StepState, StepType, TaskStatus
from shared.storage import AttemptRecord, Outstanding, TaskConflict, TaskFilter, TaskStore
from shared.storage.base import Save
from shared.task import Active, Task, new_task

NOW = 1_700_000_000.0

FLOW = Flow(
    name="provision",
    steps=(
        StepDef(
            normal=Action(module="resource", command="check", timeout=30, retry=2, max_retry_interval=-0.5),
            rollback=Action(module="monitor", command="report", timeout=60, retry=3, max_retry_interval=8),
        ),
        StepDef(normal=Action(module="mysql", command="init", timeout=1800)),  # no rollback
        StepDef(
            normal=Action(module="resource", command="deduct", timeout=200, retry=1),
            rollback=Action(module="resource", command="restore", timeout=200),
        ),
    ),
)
OTHER_FLOW = Flow(name="other", steps=(StepDef(normal=Action(module="m", command="c")),))

PARAMETERS = {
    "Cpu": 4,
    "Memory": 8.5,
    "Name": "db-ü-名前",
    "Tags": ["a", 1, None, True, {"nested": [1.25, {"deep": False}]}],
    "Empty": {},
    "Big": 2**53,
    "Huge": 2**70,  # past 64 bits: PostgreSQL's JSON encoder hands it to json
}


def submitted(
    task_id: str = "t-1",
    flow: Flow = FLOW,
    created_at: float = NOW,
    user_id: str | None = "alice",
    priority: int = 7,
    parameters: dict | None = None,
) -> Task:
    """A task as the service stores it at submit: cursor 0, status 1, step 0 queued."""
    task = new_task(task_id, flow, PARAMETERS if parameters is None else parameters, created_at, priority, user_id)
    return decide(task, Submit(), created_at).task


def waiting(task_id: str, due_at: float, created_at: float = NOW) -> Task:
    """A task whose outstanding message waits for ``due_at`` (a backoff)."""
    task = submitted(task_id, created_at=created_at)
    return replace(
        task,
        status=TaskStatus.RUNNING,
        seq=3,
        active=Active(3, 0, StepType.NORMAL, 2, Phase.WAITING, due_at=due_at),
    )


class TestTaskStoreContract:
    # --- create / get -------------------------------------------------------------

    def test_create_then_get_round_trips_every_field(self, store: TaskStore) -> None:
        task = submitted()
        stored, created = store.create(task, NOW)
        assert created is True
        assert stored == replace(task, version=1)
        assert store.get(task.task_id) == replace(task, version=1)

    def test_save_round_trips_every_field_of_a_task_in_any_state(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        busy = replace(
            task.with_step(
                0,
                state=StepState.SUCCEEDED,
                rollback_state=StepState.FAILED,
                code=StepCode.TIMED_OUT,
                message="rollback timed out after 60s",
                time_start=NOW + 1.5,
                time_end=NOW + 2.25,
                rollback_time_start=NOW + 9.0,
                rollback_time_end=NOW + 10.125,
                attempts=3,
                rollback_attempts=4,
            ).with_step(1, state=StepState.CANCELLED, rollback_state=StepState.SKIPPED, code=StepCode.CANCELLED),
            status=TaskStatus.ROLLING_BACK,
            cursor=2,
            parameters={**PARAMETERS, "InstanceId": "i-123"},
            message="step 2 (resource.deduct) failed: no quota",
            started_at=NOW + 1.0,
            ended_at=NOW + 99.0,
            cancel_requested=True,
            seq=9,
            active=Active(9, 0, StepType.ROLLBACK, 2, Phase.RUNNING, due_at=NOW + 8.5, started_at=NOW + 9.0),
        )
        assert store.save(busy, NOW + 10) is True
        assert store.get(task.task_id) == replace(busy, version=2)

    def test_a_queued_message_keeps_its_count_of_requeue_holds(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        held = replace(task, active=Active(1, 0, StepType.NORMAL, 1, Phase.QUEUED, due_at=NOW + 60, held=4))
        assert store.save(held, NOW + 30) is True
        assert store.get(task.task_id) == replace(held, version=2)

    def test_get_unknown_task_is_none(self, store: TaskStore) -> None:
        assert store.get("nope") is None

    def test_get_many_returns_the_stored_tasks_among_the_ids(self, store: TaskStore) -> None:
        store.create_many([submitted("m1"), submitted("m2"), waiting("m3", NOW + 5)], NOW)
        found = {task.task_id: task for task in store.get_many(["m3", "nope", "m1"])}
        assert found == {"m1": store.get("m1"), "m3": store.get("m3")}
        assert store.get_many([]) == []

    def test_create_twice_returns_the_stored_task_and_false(self, store: TaskStore) -> None:
        first, _ = store.create(submitted(parameters={"Cpu": 1}), NOW)
        again, created = store.create(submitted(parameters={"Cpu": 2}, created_at=NOW + 5), NOW + 5)
        assert created is False
        assert again == first
        assert store.get("t-1") == first
        assert len(store.list(TaskFilter(limit=100))) == 1

    def test_create_same_id_for_another_user_is_a_conflict(self, store: TaskStore) -> None:
        store.create(submitted(user_id="alice"), NOW)
        with pytest.raises(TaskConflict):
            store.create(submitted(user_id="bob"), NOW + 1)
        with pytest.raises(TaskConflict):
            store.create(submitted(user_id=None), NOW + 1)
        assert store.get("t-1").user_id == "alice"  # type: ignore[union-attr]

    def test_create_same_id_for_another_flow_is_a_conflict(self, store: TaskStore) -> None:
        store.create(submitted(), NOW)
        with pytest.raises(TaskConflict):
            store.create(submitted(flow=OTHER_FLOW), NOW + 1)
        assert store.get("t-1").flow == "provision"  # type: ignore[union-attr]

    # --- create_many: a batch, all or nothing --------------------------------------

    def test_create_many_stores_new_tasks_and_returns_stored_ones(self, store: TaskStore) -> None:
        old, _ = store.create(submitted("old"), NOW)
        batch = [submitted(f"n{i}", priority=i) for i in range(3)] + [submitted("old", created_at=NOW + 5)]
        result = store.create_many(batch, NOW + 5)
        assert result == [(replace(t, version=1), True) for t in batch[:3]] + [(old, False)]
        for task in batch[:3]:
            assert store.get(task.task_id) == replace(task, version=1)
        assert store.get("old") == old

    def test_create_many_with_one_conflict_stores_nothing(self, store: TaskStore) -> None:
        store.create(submitted("taken", user_id="alice"), NOW)
        batch = [submitted("n0"), submitted("taken", user_id="bob"), submitted("n1")]
        with pytest.raises(TaskConflict, match="taken"):
            store.create_many(batch, NOW)
        assert store.get("n0") is None and store.get("n1") is None
        assert store.get("taken").user_id == "alice"  # type: ignore[union-attr]

    def test_create_many_each_answers_a_conflict_alone_and_stores_the_others(self, store: TaskStore) -> None:
        # Concurrent single submits committed together: one refused takes nothing from the others.
        old, _ = store.create(submitted("taken", user_id="alice"), NOW)
        batch = [submitted("n0"), submitted("taken", user_id="bob"), submitted("taken2"), submitted("n1")]
        store.create(submitted("taken2", user_id="alice"), NOW)
        result = store.create_many(batch, NOW + 5, each=True)
        assert result[0] == (replace(batch[0], version=1), True)
        assert isinstance(result[1], TaskConflict) and "taken" in str(result[1])
        assert result[2] == (store.get("taken2"), False)  # the same request again: a replay
        assert result[3] == (replace(batch[3], version=1), True)
        assert store.get("n0") == replace(batch[0], version=1) and store.get("n1") == replace(batch[3], version=1)
        assert store.get("taken") == old

    def test_create_many_of_one_task(self, store: TaskStore) -> None:
        # A batch of one runs without a transaction around it on PostgreSQL: it must still create, replay and refuse.
        assert store.create_many([submitted("one")], NOW, each=True) == [(replace(submitted("one"), version=1), True)]
        assert store.create_many([submitted("one")], NOW, each=True) == [(store.get("one"), False)]
        [refused] = store.create_many([submitted("one", user_id="bob")], NOW, each=True)
        assert isinstance(refused, TaskConflict)
        with pytest.raises(TaskConflict):
            store.create_many([submitted("one", user_id="bob")], NOW)

    def test_create_many_keeps_every_value_as_given(self, store: TaskStore) -> None:
        # PostgreSQL takes a batch's columns as arrays: no value may be read back otherwise than given.
        awkward = {
            "quote": 'say "hi"\\n',
            "braces": "{a,b} (c) 'd'",
            "nested": [[1, 2], [], [["deep"]]],
            "unicode": "é 中文 🙂",
            "none": None,
            "numbers": [0, -1, 1.5, 2**53],
            "flag": False,
        }
        batch = [submitted(f"a{i}", user_id=None if i else 'o"dd, {user}', parameters={"i": i, **awkward}) for i in range(3)]
        assert store.create_many(batch, NOW, each=True) == [(replace(t, version=1), True) for t in batch]
        assert [store.get(t.task_id) for t in batch] == [replace(t, version=1) for t in batch]

    def test_batches_of_the_same_ids_in_opposite_orders_wait_for_each_other_instead_of_deadlocking(
        self, store: TaskStore
    ) -> None:
        # Concurrent replays of the same requests reach two API processes in different orders.
        failures: list[BaseException] = []
        created: list[int] = []

        def create(ids: list[str]) -> None:
            try:
                answers = store.create_many([submitted(i) for i in ids], NOW, each=True)
                created.append(sum(1 for a in answers if not isinstance(a, TaskConflict) and a[1]))
            except BaseException as exc:  # surfaced below
                failures.append(exc)

        for round_ in range(5):
            ids = [f"o{round_}-{i}" for i in range(30)]
            racers = [threading.Thread(target=create, args=(order,)) for order in (ids, ids[::-1])]
            for racer in racers:
                racer.start()
            for racer in racers:
                racer.join(30)
        assert not failures, failures
        assert sum(created) == 5 * 30  # each id created once, by one of the two

    def test_create_many_racing_single_creates_of_its_ids(self, store: TaskStore) -> None:
        # Whoever commits an id first owns it: the batch neither fails nor claims the others'.
        ids = [f"r{i}" for i in range(40)]
        singles: dict[str, bool] = {}

        def create_each() -> None:
            for task_id in reversed(ids):
                singles[task_id] = store.create(submitted(task_id), NOW)[1]

        racer = threading.Thread(target=create_each)
        racer.start()
        batch = store.create_many([submitted(i) for i in ids], NOW)
        racer.join()
        assert [t.task_id for t, _ in batch] == ids
        assert [created + singles[task_id] for task_id, (_, created) in zip(ids, batch, strict=True)] == [1] * 40

    # --- save: compare-and-set on the version ---------------------------------------

    def test_save_with_the_current_version_writes_and_bumps_the_version(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        assert task.version == 1
        assert store.save(replace(task, status=TaskStatus.RUNNING, started_at=NOW + 1), NOW + 1) is True
        stored = store.get(task.task_id)
        assert stored is not None
        assert (stored.version, stored.status, stored.started_at) == (2, TaskStatus.RUNNING, NOW + 1)
        assert store.save(replace(stored, message="second"), NOW + 2) is True
        assert store.get(task.task_id).version == 3  # type: ignore[union-attr]

    def test_save_with_a_stale_version_writes_nothing(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        assert store.save(replace(task, message="winner"), NOW + 1) is True
        before = store.get(task.task_id)
        attempt = AttemptRecord(task.task_id, 1, 0, StepType.NORMAL, 1, "resource", "check", started_at=NOW)
        assert store.save(replace(task, message="loser", status=TaskStatus.FAILED), NOW + 2, attempt) is False
        assert store.get(task.task_id) == before
        assert before is not None and before.message == "winner" and before.version == 2
        assert store.attempts(task.task_id) == []

    def test_save_of_a_copy_from_another_creation_of_the_id_writes_nothing(self, store: TaskStore) -> None:
        """A first message carries its task as created; if that task was deleted and its id
        reused since, the version alone would match the new task's, the creation time does not."""
        old_copy = replace(submitted(created_at=NOW), version=1)
        task, _ = store.create(submitted(created_at=NOW + 60, parameters={"Name": "new"}), NOW + 60)
        assert store.save(replace(old_copy, status=TaskStatus.RUNNING), NOW + 61) is False
        assert store.get(task.task_id) == task

    def test_save_of_an_unknown_task_writes_nothing(self, store: TaskStore) -> None:
        assert store.save(replace(submitted("ghost"), version=1), NOW) is False
        assert store.get("ghost") is None

    def test_concurrent_saves_of_one_version_have_exactly_one_winner(self, store: TaskStore) -> None:
        writers = 8
        task, _ = store.create(submitted(), NOW)
        for round_ in range(3):
            base = store.get(task.task_id)
            assert base is not None and base.version == round_ + 1
            barrier = threading.Barrier(writers)
            results: dict[int, bool] = {}
            errors: list[BaseException] = []

            def write(i: int, base: Task = base, barrier: threading.Barrier = barrier) -> None:
                try:
                    barrier.wait(timeout=30)
                    results[i] = store.save(replace(base, message=f"writer {i}"), NOW + i)
                except BaseException as exc:  # reported below, with the thread's traceback
                    errors.append(exc)

            threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            assert len(results) == writers
            winners = [i for i, ok in results.items() if ok]
            assert len(winners) == 1, results
            stored = store.get(task.task_id)
            assert stored is not None
            assert stored.version == base.version + 1
            assert stored.message == f"writer {winners[0]}"

    # --- attempts ---------------------------------------------------------------------

    def test_attempt_records_are_inserted_then_updated(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        first = AttemptRecord(task.task_id, 1, 0, StepType.NORMAL, 1, "resource", "check", started_at=NOW + 1)
        assert store.save(replace(task, status=TaskStatus.RUNNING), NOW + 1, first)
        assert store.attempts(task.task_id) == [first]

        task = store.get(task.task_id)
        assert task is not None
        finished = AttemptRecord(
            task.task_id, 1, 0, StepType.NORMAL, 1, "resource", "check",
            ended_at=NOW + 2, outcome="failed", error="RuntimeError: boom",
        )
        assert store.save(replace(task, message="retrying"), NOW + 2, finished)
        assert store.attempts(task.task_id) == [replace(finished, started_at=NOW + 1)]

        task = store.get(task.task_id)
        assert task is not None
        rollback = AttemptRecord(task.task_id, 2, 0, StepType.ROLLBACK, 1, "monitor", "report", started_at=NOW + 3)
        assert store.save(task, NOW + 3, rollback)
        assert store.attempts(task.task_id) == [replace(finished, started_at=NOW + 1), rollback]
        assert store.attempts("other") == []

    def test_a_whole_attempt_is_written_at_once_and_only_with_its_transition(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        whole = AttemptRecord(
            task.task_id, 1, 0, StepType.NORMAL, 1, "resource", "check",
            started_at=NOW + 1, ended_at=NOW + 2, outcome="succeeded",
        )
        assert store.save(replace(task, status=TaskStatus.RUNNING), NOW + 2, whole)
        assert store.attempts(task.task_id) == [whole]
        # A lost compare-and-set writes no attempt, neither an insert nor an update.
        late = replace(whole, seq=2, started_at=NOW + 3)
        assert store.save(replace(task, message="stale"), NOW + 3, late) is False
        update_of_stale = replace(whole, started_at=None, outcome="failed", error="late")
        assert store.save(replace(task, message="stale"), NOW + 3, update_of_stale) is False
        assert store.attempts(task.task_id) == [whole]

    def test_an_outcome_and_the_next_start_are_written_together_or_not_at_all(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        first = AttemptRecord(task.task_id, 1, 0, StepType.NORMAL, 1, "m", "c", started_at=NOW + 1, worker="h:1")
        assert store.save(replace(task, status=TaskStatus.RUNNING), NOW + 1, first)
        task = store.get(task.task_id)
        assert task is not None
        ended = AttemptRecord(task.task_id, 1, 0, StepType.NORMAL, 1, "m", "c", ended_at=NOW + 2, outcome="succeeded")
        following = AttemptRecord(task.task_id, 2, 1, StepType.NORMAL, 1, "n", "d", started_at=NOW + 2, worker="h:1")
        # A lost compare-and-set writes neither.
        assert store.save(replace(task, version=task.version - 1), NOW + 2, ended, next_attempt=following) is False
        assert store.attempts(task.task_id) == [first]
        assert store.save(replace(task, cursor=1), NOW + 2, ended, next_attempt=following)
        assert store.attempts(task.task_id) == [replace(first, ended_at=NOW + 2, outcome="succeeded"), following]

    def test_save_many_writes_each_whose_version_matches_with_its_attempts(self, store: TaskStore) -> None:
        tasks = [store.create(submitted(f"t-{i}"), NOW)[0] for i in range(5)]
        starts = [AttemptRecord(t.task_id, 1, 0, StepType.NORMAL, 1, "m", "c", started_at=NOW + 1) for t in tasks]
        stale = replace(tasks[3], version=tasks[3].version + 1)  # another writer got there first
        saves = [Save(replace(t, status=TaskStatus.RUNNING), NOW + 1, a) for t, a in zip(tasks, starts, strict=True)]
        saves[3] = saves[3]._replace(task=replace(stale, status=TaskStatus.RUNNING))
        # Not in the order of their ids: the store may reorder them, the answers may not.
        order = [4, 0, 3, 2, 1]
        assert store.save_many([saves[i] for i in order]) == [i != 3 for i in order]
        for i, task in enumerate(tasks):
            stored = store.get(task.task_id)
            assert stored is not None
            if i == 3:
                assert stored == task and store.attempts(task.task_id) == []
            else:
                assert (stored.version, stored.status) == (task.version + 1, TaskStatus.RUNNING)
                assert store.attempts(task.task_id) == [starts[i]]

    def test_heartbeats_update_the_started_attempt_and_keep_its_worker(self, store: TaskStore) -> None:
        task, _ = store.create(submitted(), NOW)
        kind = dict(task_id=task.task_id, seq=1, cursor=0, type=StepType.NORMAL, attempt=1, module="m", command="c")
        started = AttemptRecord(**kind, started_at=NOW + 1, worker="host:41")
        assert started.write == "insert"
        assert store.save(replace(task, status=TaskStatus.RUNNING), NOW + 1, started)
        for beat, progress in ((2, {"rows": 10}), (3, {"rows": 20, "of": [1, "x"]})):
            task = store.get(task.task_id)
            assert task is not None
            heartbeat = AttemptRecord(**kind, heartbeat_at=NOW + beat, progress=progress, worker="host:41")
            assert heartbeat.write == "heartbeat"
            assert store.save(task, NOW + beat, heartbeat)
        [stored] = store.attempts(task.task_id)
        assert stored == replace(started, heartbeat_at=NOW + 3, progress={"rows": 20, "of": [1, "x"]})

        task = store.get(task.task_id)
        assert task is not None
        done = AttemptRecord(**kind, ended_at=NOW + 4, outcome="succeeded", result={"Cpu": 4, "ok": True})
        assert store.save(task, NOW + 4, done)
        [stored] = store.attempts(task.task_id)
        # The outcome keeps what the start and the heartbeats wrote.
        assert stored == replace(
            started, heartbeat_at=NOW + 3, progress={"rows": 20, "of": [1, "x"]},
            ended_at=NOW + 4, outcome="succeeded", result={"Cpu": 4, "ok": True},
        )

    # --- list -----------------------------------------------------------------------------

    def test_list_is_newest_first_and_filters_by_flow_status_user_and_limit(self, store: TaskStore) -> None:
        rows = [
            ("a", FLOW, "alice", TaskStatus.PENDING),
            ("b", OTHER_FLOW, "bob", TaskStatus.RUNNING),
            ("c", FLOW, "bob", TaskStatus.SUCCESS),
            ("d", OTHER_FLOW, "alice", TaskStatus.RUNNING),
            ("e", FLOW, None, TaskStatus.RUNNING),
        ]
        for i, (task_id, flow, user, status) in enumerate(rows):
            task, _ = store.create(submitted(task_id, flow=flow, user_id=user, created_at=NOW + i), NOW + i)
            if status is not TaskStatus.PENDING:
                assert store.save(replace(task, status=status), NOW + i)

        def ids(**where: object) -> list[str]:
            return [t.task_id for t in store.list(TaskFilter(**where))]  # type: ignore[arg-type]

        assert ids() == ["e", "d", "c", "b", "a"]
        assert ids(flow="provision") == ["e", "c", "a"]
        assert ids(flow="nope") == []
        assert ids(status=TaskStatus.RUNNING) == ["e", "d", "b"]
        assert ids(status=TaskStatus.FAILED) == []
        assert ids(user_id="alice") == ["d", "a"]
        assert ids(user_id="bob", status=TaskStatus.SUCCESS) == ["c"]
        assert ids(flow="other", user_id="alice", status=TaskStatus.RUNNING) == ["d"]
        assert ids(limit=2) == ["e", "d"]
        assert ids(flow="provision", limit=1) == ["e"]
        assert store.list(TaskFilter())[0] == store.get("e")

    # --- due -------------------------------------------------------------------------------

    def test_due_returns_outstanding_messages_whose_time_has_come_oldest_first(self, store: TaskStore) -> None:
        store.create(waiting("early", due_at=NOW + 10), NOW)
        store.create(waiting("on-time", due_at=NOW + 20, created_at=NOW + 1), NOW + 1)
        store.create(waiting("later", due_at=NOW + 30, created_at=NOW + 2), NOW + 2)
        queued = submitted("queued", created_at=NOW + 3)  # queued: due when it must be re-published
        assert queued.active is not None and queued.active.due_at is not None
        store.create(queued, NOW + 3)
        done, _ = store.create(submitted("finished", created_at=NOW + 4), NOW + 4)
        store.save(replace(done, status=TaskStatus.SUCCESS, active=None, ended_at=NOW + 5), NOW + 5)

        assert store.due(NOW + 5, 100, Outstanding.LATER) == []
        assert store.due(NOW + 10, 100, Outstanding.LATER) == [("early", 3, Phase.WAITING)]
        assert store.due(NOW + 20, 100, Outstanding.LATER) == [("early", 3, Phase.WAITING), ("on-time", 3, Phase.WAITING)]
        assert store.due(NOW + 20, 100, Outstanding.SENT) == []
        # Each kind is asked for apart: waiting later steps, sent messages, a batch's first steps.
        assert [t for t, _, _ in store.due(NOW + 10_000, 100, Outstanding.LATER)] == ["early", "on-time", "later"]
        assert store.due(NOW + 10_000, 100, Outstanding.SENT) == [("queued", 1, Phase.QUEUED)]
        assert store.due(NOW + 10_000, 100, Outstanding.FIRST) == []
        assert len(store.due(NOW + 10_000, 2, Outstanding.LATER)) == 2

        # A message moved past its due time is no longer due; a finished task never is.
        early = store.get("early")
        assert early is not None and early.active is not None
        store.save(replace(early, active=replace(early.active, phase=Phase.QUEUED, due_at=NOW + 500)), NOW + 11)
        assert "early" not in [t for kind in Outstanding for t, _, _ in store.due(NOW + 100, 100, kind)]
        assert store.due(NOW + 10_000, 100, Outstanding.SENT) == [("queued", 1, Phase.QUEUED), ("early", 3, Phase.QUEUED)]
        assert "finished" not in [t for kind in Outstanding for t, _, _ in store.due(NOW + 10_000, 100, kind)]

    def test_a_batch_s_first_steps_are_due_apart_flow_by_flow(self, store: TaskStore) -> None:
        def first(task_id: str, flow: str, created_at: float) -> Task:
            of_flow = FLOW.model_copy(update={"name": flow})
            return decide(new_task(task_id, of_flow, {}, created_at), Submit(deferred=True), created_at).task

        store.create_many([first("b1", "beta", NOW + 1), first("a1", "alpha", NOW + 2), first("b2", "beta", NOW + 3)], NOW)
        store.create(waiting("retry", due_at=NOW), NOW)
        assert store.waiting_flows() == ["beta", "alpha"]  # the flow of the oldest first
        assert store.due(NOW + 10, 100, Outstanding.FIRST) == [
            ("b1", 1, Phase.WAITING), ("a1", 1, Phase.WAITING), ("b2", 1, Phase.WAITING),
        ]
        assert [t for t, _, _ in store.due(NOW + 10, 100, Outstanding.FIRST, "beta")] == ["b1", "b2"]
        assert [t for t, _, _ in store.due(NOW + 10, 1, Outstanding.FIRST, "beta")] == ["b1"]
        assert [t for t, _, _ in store.due(NOW + 10, 100, Outstanding.LATER)] == ["retry"]
        published = store.get("a1")
        assert published is not None and published.active is not None
        store.save(replace(published, active=replace(published.active, phase=Phase.QUEUED, due_at=NOW + 60)), NOW + 5)
        assert store.waiting_flows() == ["beta"]

    def test_ping(self, store: TaskStore) -> None:
        store.ping()
