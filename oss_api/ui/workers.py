"""The Workers and queues page: the registry's processes, and each module's queue.

A module row shows its queue's depth (asked of the broker, under the scrape's
deadline), its queue wait (publish to start, from the live workers' histograms)
and the live workers serving it with the attempts they run now. A process is
live while it renews its registry row (shared.presence); the others are listed
below, greyed, for what they last said.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import Response

from oss_api.metrics import StackMetrics
from oss_api.ui.render import page
from oss_api.ui.session import ViewerDep
from shared.exposition import Family, is_live, merge
from shared.messaging import queue_name
from shared.runtime import Runtime
from shared.storage.base import ProcessRecord

QUEUE_WAIT = "asyncflow_step_queue_wait_seconds"
# Processes that stopped or went silent are listed for this long after they were last seen.
GONE_SHOWN_FOR = 3600.0


@dataclass(frozen=True)
class ModuleRow:
    module: str
    queue: str
    depth: int | None  # None: the broker did not answer in time
    wait_p50: float | None
    wait_p99: float | None
    workers: list[ProcessRecord] = field(default_factory=list)


def quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of a cumulative histogram."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    return next(le for le, count in ordered if count >= rank)


def queue_waits(families: Iterable[Family]) -> dict[str, tuple[float | None, float | None]]:
    """p50 and p99 queue wait per module, from merged snapshots of the step-wait histogram."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in families:
        if family["name"] != QUEUE_WAIT:
            continue
        for name, labels, value in family["samples"]:
            if name.endswith("_bucket"):
                buckets.setdefault(labels["module"], []).append((float(labels["le"]), float(value)))
    return {module: (quantile(b, 0.5), quantile(b, 0.99)) for module, b in buckets.items()}


def module_rows(
    modules: Iterable[str],
    records: Sequence[ProcessRecord],
    now: float,
    interval: float,
    depths: Mapping[str, int] | None,
) -> list[ModuleRow]:
    live = [r for r in records if r.role == "worker" and is_live(r, now, interval)]
    waits = queue_waits(merge((r.metrics, True) for r in live))
    rows = []
    for module in sorted(modules):
        queue = queue_name(module)
        p50, p99 = waits.get(module, (None, None))
        serving = sorted((r for r in live if module in r.detail.get("modules", ())), key=lambda r: (r.host, r.pid))
        depth = depths.get(queue) if depths is not None else None
        rows.append(ModuleRow(module, queue, depth, p50, p99, serving))
    return rows


def split(records: Sequence[ProcessRecord], now: float, interval: float) -> tuple[list[ProcessRecord], list[ProcessRecord]]:
    """(live processes, those stopped or silent within GONE_SHOWN_FOR), each by role then host."""
    order = sorted(records, key=lambda r: (r.role, r.host, r.pid))
    live = [r for r in order if is_live(r, now, interval)]
    gone = [r for r in order if not is_live(r, now, interval) and now - r.seen_at <= GONE_SHOWN_FOR]
    return live, gone


def worker_routes(runtime: Runtime) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False)

    @router.get("/workers")
    def workers(request: Request, who: ViewerDep) -> Response:
        stack: StackMetrics = request.app.state.stack_metrics
        now = stack.presence.clock()
        interval = runtime.settings.heartbeat_interval
        records = [stack.presence.record()] + [
            r for r in runtime.process_store.list() if r.process_id != stack.presence.process_id
        ]
        modules = sorted(runtime.flows.push_module_names())
        depths = stack.queue_depths([queue_name(m) for m in modules])
        live, gone = split(records, now, interval)
        return page(
            request,
            who,
            "workers.html",
            title="Workers and queues",
            rows=module_rows(modules, records, now, interval, depths),
            live=live,
            gone=gone,
            pull_modules=sorted(runtime.flows.pull_modules()),
            interval=interval,
        )

    return router
