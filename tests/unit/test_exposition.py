"""The stack's exposition: snapshots of processes added up and rendered (shared.exposition)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from shared.exposition import is_live, merge, render, snapshot, stack
from shared.storage.base import ProcessRecord

INTERVAL = 5.0
NOW = 1000.0


def registry_with(attempts: float, seconds: list[float], leader: float) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("asyncflow_step_attempts_total", "attempts", ["module", "outcome"], registry=registry)
    counter.labels("alpha", "succeeded").inc(attempts)
    counter.labels("beta", "failed").inc(1)
    histogram = Histogram("asyncflow_step_seconds", "step", ["module"], buckets=(0.1, 1.0), registry=registry)
    for s in seconds:
        histogram.labels("alpha").observe(s)
    Gauge("asyncflow_scheduler_leader", "leads", registry=registry).set(leader)
    Counter("other_library_total", "not ours", registry=registry).inc()
    return registry


def samples(families: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(name, tuple(sorted(labels.items()))): value for f in families for name, labels, value in f["samples"]}


def row(process_id: str, metrics: Any, seen_at: float = NOW, stopped_at: float | None = None, role: str = "worker") -> ProcessRecord:
    return ProcessRecord(process_id, role, "h", 1, 0.0, seen_at, {}, metrics, stopped_at)


def test_snapshot_keeps_our_families_without_created_timestamps() -> None:
    families = snapshot(registry_with(2, [0.05], 1))
    assert [f["name"] for f in families] == [
        "asyncflow_step_attempts", "asyncflow_step_seconds", "asyncflow_scheduler_leader"
    ]
    assert not any(name.endswith("_created") for name, _ in samples(families))
    assert samples(families)[("asyncflow_step_attempts_total", (("module", "alpha"), ("outcome", "succeeded")))] == 2


def test_counters_are_summed_per_label_set_and_histograms_bucket_by_bucket() -> None:
    a = snapshot(registry_with(2, [0.05, 0.5], 0))
    b = snapshot(registry_with(3, [0.05, 5.0], 0))
    merged = samples(merge([(a, True), (b, False)]))  # a stopped process's counts stay in the totals
    alpha = (("module", "alpha"), ("outcome", "succeeded"))
    assert merged[("asyncflow_step_attempts_total", alpha)] == 5
    assert merged[("asyncflow_step_attempts_total", (("module", "beta"), ("outcome", "failed")))] == 2
    buckets = {le: merged[("asyncflow_step_seconds_bucket", (("le", le), ("module", "alpha")))] for le in ("0.1", "1.0", "+Inf")}
    assert buckets == {"0.1": 2, "1.0": 3, "+Inf": 4}
    assert merged[("asyncflow_step_seconds_count", (("module", "alpha"),))] == 4
    assert merged[("asyncflow_step_seconds_sum", (("module", "alpha"),))] == 0.05 + 0.5 + 0.05 + 5.0


def test_gauges_count_only_from_live_processes() -> None:
    live, dead = snapshot(registry_with(1, [], 1)), snapshot(registry_with(1, [], 1))
    merged = samples(merge([(live, True), (dead, False)]))
    assert merged[("asyncflow_scheduler_leader", ())] == 1
    assert "asyncflow_scheduler_leader" not in {f["name"] for f in merge([(dead, False)])}


def test_histograms_with_other_bounds_stay_cumulative() -> None:
    one = [{"name": "h", "type": "histogram", "help": "", "samples": [
        ["h_bucket", {"le": "1.0"}, 1.0], ["h_bucket", {"le": "+Inf"}, 2.0], ["h_count", {}, 2.0], ["h_sum", {}, 3.0]]}]
    other = [{"name": "h", "type": "histogram", "help": "", "samples": [
        ["h_bucket", {"le": "0.5"}, 1.0], ["h_bucket", {"le": "2.0"}, 3.0], ["h_bucket", {"le": "+Inf"}, 4.0],
        ["h_count", {}, 4.0], ["h_sum", {}, 6.0]]}]
    merged = samples(merge([(one, True), (other, True)]))
    bounds = {le: merged[("h_bucket", (("le", le),))] for le in ("0.5", "1.0", "2.0", "+Inf")}
    # "one" has nothing at or below 0.5, and its 1.0 bucket stands for 2.0.
    assert bounds == {"0.5": 1, "1.0": 2, "2.0": 4, "+Inf": 6}
    assert merged[("h_count", ())] == 6


def test_a_family_redefined_with_another_type_is_left_out_of_that_process() -> None:
    counter = [{"name": "x", "type": "counter", "help": "", "samples": [["x_total", {}, 1.0]]}]
    gauge = [{"name": "x", "type": "gauge", "help": "", "samples": [["x", {}, 7.0]]}]
    assert samples(merge([(counter, True), (gauge, True)])) == {("x_total", ()): 1}


def test_liveness_is_three_heartbeats_and_not_stopped() -> None:
    assert is_live(row("p", [], seen_at=NOW - 3 * INTERVAL), NOW, INTERVAL)
    assert not is_live(row("p", [], seen_at=NOW - 3 * INTERVAL - 0.1), NOW, INTERVAL)
    assert not is_live(row("p", [], stopped_at=NOW), NOW, INTERVAL)


def test_stack_uses_its_own_fresh_values_and_counts_processes() -> None:
    stale_own = snapshot(registry_with(1, [], 0))
    fresh_own = snapshot(registry_with(10, [], 0))
    rows = [
        row("api:1", stale_own, role="api"),
        row("worker:2", snapshot(registry_with(2, [], 0))),
        row("gone:3", snapshot(registry_with(4, [], 0)), seen_at=NOW - 60),
        row("done:4", snapshot(registry_with(8, [], 0)), seen_at=NOW - 30, stopped_at=NOW - 30),
    ]
    own = row("api:1", fresh_own, role="api")
    merged = samples(stack(rows, own, NOW, INTERVAL))
    assert merged[("asyncflow_step_attempts_total", (("module", "alpha"), ("outcome", "succeeded")))] == 10 + 2 + 4 + 8
    assert merged[("asyncflow_processes", (("role", "api"),))] == 1
    assert merged[("asyncflow_processes", (("role", "worker"),))] == 1  # the silent one is gone
    assert merged[("asyncflow_processes", (("role", "scheduler"),))] == 0
    assert merged[("asyncflow_process_last_seen_seconds", (("process_id", "gone:3"), ("role", "worker")))] == 60
    assert ("asyncflow_process_last_seen_seconds", (("process_id", "done:4"), ("role", "worker"))) not in merged


def test_stack_counts_itself_before_its_first_row() -> None:
    merged = samples(stack([], row("api:1", snapshot(registry_with(1, [], 0)), role="api"), NOW, INTERVAL))
    assert merged[("asyncflow_processes", (("role", "api"),))] == 1


def test_render_writes_what_prometheus_parses_back() -> None:
    families = merge([(snapshot(registry_with(2, [0.05], 1)), True)])
    parsed = {f.name: f for f in text_string_to_metric_families(render(families).decode())}
    assert parsed["asyncflow_step_attempts"].type == "counter"
    assert parsed["asyncflow_step_seconds"].type == "histogram"
    assert parsed["asyncflow_scheduler_leader"].type == "gauge"
    by_sample = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parsed.values() for s in f.samples}
    assert by_sample[("asyncflow_step_attempts_total", (("module", "alpha"), ("outcome", "succeeded")))] == 2
    assert by_sample[("asyncflow_step_seconds_bucket", (("le", "0.1"), ("module", "alpha")))] == 1
