"""One Prometheus exposition for the whole stack, from the snapshots of its processes.

Pure functions: :func:`snapshot` turns a registry into plain data (what a process
stores in its registry row), :func:`merge` adds the snapshots of many processes
up, :func:`render` writes the text format. A family is a dict::

    {"name": "asyncflow_step_seconds", "type": "histogram", "help": "...",
     "samples": [["asyncflow_step_seconds_bucket", {"module": "m", "le": "0.5"}, 3.0], ...]}

Counters, histograms and summaries of every process kept are summed, stopped
ones included (their counts stay in the totals until their row is purged);
gauges say how things are now, so only live processes' count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from shared.storage.base import ProcessRecord

Family = Mapping[str, Any]
Labels = tuple[tuple[str, str], ...]  # a label set as sorted (name, value) pairs
PREFIX = "asyncflow_"
# A process not seen for this many heartbeat intervals counts as gone (as a silent attempt does).
MISSED_BEATS = 3
_SUMMED = ("counter", "histogram", "summary")


def snapshot(registry: CollectorRegistry, prefix: str = PREFIX) -> list[Family]:
    """The families of ``registry`` named ``prefix``…, as plain data.

    Left out: other libraries' families (process_*, python_*: per-process facts
    that mean nothing summed) and the ``_created`` timestamps of counters.
    """
    families: list[Family] = []
    for metric in registry.collect():
        if not metric.name.startswith(prefix):
            continue
        samples = [
            [s.name, dict(s.labels), float(s.value)] for s in metric.samples if not s.name.endswith("_created")
        ]
        families.append({"name": metric.name, "type": metric.type, "help": metric.documentation, "samples": samples})
    return families


def is_live(record: ProcessRecord, now: float, interval: float) -> bool:
    """Running and heard from within :data:`MISSED_BEATS` heartbeat intervals."""
    return record.stopped_at is None and now - record.seen_at <= MISSED_BEATS * interval


def _key(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def _le(bound: str) -> float:
    return math.inf if bound in ("+Inf", "inf") else float(bound)


def _merge_buckets(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Cumulative buckets of one label set over processes, bound by bound.

    With the same bounds everywhere (one release) this is a plain sum. A process
    without some bound (another release) counts at it what its largest bound
    below holds, so the merged buckets stay cumulative.
    """
    bounds = sorted({b for part in parts for b in part}, key=_le)
    merged = dict.fromkeys(bounds, 0.0)
    for part in parts:
        own = sorted(((_le(b), v) for b, v in part.items()), key=lambda bv: bv[0])
        for bound in bounds:
            below = [v for b, v in own if b <= _le(bound)]
            merged[bound] += below[-1] if below else 0.0
    return merged


def _merge_family(first: Family, snapshots: Sequence[Family]) -> Family:
    order: dict[tuple[str, Labels], None] = {}  # first-seen order of samples
    sums: dict[tuple[str, Labels], float] = {}
    # Histogram buckets: (sample name, labels but le) -> one {le: value} per process.
    buckets: dict[tuple[str, Labels], list[dict[str, float]]] = {}
    for family in snapshots:
        own: dict[tuple[str, Labels], dict[str, float]] = {}
        for name, labels, value in family["samples"]:
            if "le" in labels and name.endswith("_bucket"):
                rest = {k: v for k, v in labels.items() if k != "le"}
                own.setdefault((name, _key(rest)), {})[labels["le"]] = float(value)
                order.setdefault((name, _key(rest)))
            else:
                key = (name, _key(labels))
                order.setdefault(key)
                sums[key] = sums.get(key, 0.0) + float(value)
        for key, part in own.items():
            buckets.setdefault(key, []).append(part)
    samples: list[list[Any]] = []
    for key in order:
        name, labels = key
        if key in buckets:
            for le, value in _merge_buckets(buckets[key]).items():
                samples.append([name, {**dict(labels), "le": le}, value])
        else:
            samples.append([name, dict(labels), sums[key]])
    return {"name": first["name"], "type": first["type"], "help": first["help"], "samples": samples}


def merge(parts: Iterable[tuple[Sequence[Family], bool]]) -> list[Family]:
    """Add up the snapshots in ``parts``, each (families of one process, whether it is live).

    Same family name, same type: samples with the same labels are summed
    (histogram buckets bound by bound). A family whose type differs from the
    first process's (a metric redefined by another release) is left out of
    that process's contribution.
    """
    grouped: dict[str, list[Family]] = {}
    for families, live in parts:
        for family in families:
            if family["type"] not in _SUMMED and not live:
                continue
            same = grouped.setdefault(family["name"], [])
            if same and same[0]["type"] != family["type"]:
                continue
            same.append(family)
    return [_merge_family(same[0], same) for _, same in sorted(grouped.items())]


def gauge(name: str, help_text: str, values: Mapping[Labels, float]) -> Family:
    """A gauge family of ``values``, each keyed by its labels as (name, value) pairs."""
    return {
        "name": name,
        "type": "gauge",
        "help": help_text,
        "samples": [[name, dict(labels), float(v)] for labels, v in sorted(values.items())],
    }


def process_families(records: Iterable[ProcessRecord], now: float, interval: float) -> list[Family]:
    """``asyncflow_processes{role}`` (live ones) and ``asyncflow_process_last_seen_seconds``
    (seconds since each process not stopped was last heard from: a silent one's grows)."""
    live: dict[Labels, float] = {(("role", r),): 0.0 for r in ("api", "scheduler", "worker")}
    seen: dict[Labels, float] = {}
    for r in records:
        if is_live(r, now, interval):
            key = (("role", r.role),)
            live[key] = live.get(key, 0.0) + 1
        if r.stopped_at is None:
            seen[(("process_id", r.process_id), ("role", r.role))] = max(0.0, now - r.seen_at)
    return [
        gauge("asyncflow_processes", "Live processes of the stack, by role", live),
        gauge("asyncflow_process_last_seen_seconds", "Seconds since a running process last renewed its row", seen),
    ]


def stack(records: Iterable[ProcessRecord], own: ProcessRecord, now: float, interval: float) -> list[Family]:
    """The stack's families: every process's snapshot, with ``own`` (the process
    rendering them, metrics fresh) in place of its stored row, plus the process gauges."""
    rows = [r for r in records if r.process_id != own.process_id] + [own]
    merged = merge((r.metrics, r is own or is_live(r, now, interval)) for r in rows)
    return merged + process_families(rows, now, interval)


class _Families(Collector):
    def __init__(self, families: Sequence[Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            metric = Metric(family["name"], family["help"], family["type"])
            for name, labels, value in family["samples"]:
                metric.add_sample(name, labels, value)
            yield metric


def render(families: Sequence[Family]) -> bytes:
    """The Prometheus text format of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
