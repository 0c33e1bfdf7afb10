"""Figures of an end-to-end run: distributions from the task documents, and the report.

Every latency comes from the server's timestamps: the task document's
``time_create`` and ``time_end``, and the ``started_at`` and ``ended_at`` of each
attempt in its attempt log.
"""

from __future__ import annotations

from typing import Any

from shared.states import STOPPED  # success, failed, rollback failed, cancelled

STEPS = 3
SUCCESS = 0

# SPEC.md §12, quoted (not measured here).
SPEC_REFERENCE = {
    "source": "SPEC.md §12 (2-core machine, PostgreSQL and RabbitMQ on it); quoted, not measured by this run",
    "targets": {
        "e2e_flows_per_s_min": 400,
        "e2e_p50_ms_at_50_per_s_max": 15,
        "step_dispatch_p50_ms_max": 5,
        "step_dispatch_p99_ms_max": 50,
    },
    "peers": [
        {"what": "Celery chain on RabbitMQ, no durable state", "flows_per_s": 334},
        {"what": "Celery chain + one PostgreSQL update per step", "flows_per_s": 270, "p50_ms_at_50_per_s": 7},
        {"what": "DBOS", "flows_per_s": "76-124", "p50_ms_at_50_per_s": "11-24"},
    ],
}


# --- figures -------------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float | None:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist_ms(seconds: list[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in seconds]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50": round(pct(ms, 50), 2),
        "p90": round(pct(ms, 90), 2),
        "p99": round(pct(ms, 99), 2),
        "max": round(max(ms), 2),
        "mean": round(sum(ms) / len(ms), 2),
    }


def analyse(docs: list[dict[str, Any]]) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    done = [d for d in docs if d["task_status"] in STOPPED]
    for d in docs:
        statuses[d["status_name"]] = statuses.get(d["status_name"], 0) + 1
    ok = [d for d in done if d["task_status"] == SUCCESS]

    first_dispatch: list[float] = []
    next_dispatch: list[float] = []
    by_step: dict[int, list[float]] = {k: [] for k in range(1, STEPS)}
    in_step: list[float] = []
    finish: list[float] = []
    e2e: list[float] = []
    retried = 0
    for d in ok:
        e2e.append(d["time_end"] - d["time_create"])
        normal = sorted((a for a in d.get("attempts") or [] if a["type"] == 0), key=lambda a: a["seq"])
        if len(normal) != STEPS:
            retried += 1  # a retried attempt would blur the per-step figures; leave it out
            continue
        first_dispatch.append(normal[0]["started_at"] - d["time_create"])
        for k in range(1, STEPS):
            gap = normal[k]["started_at"] - normal[k - 1]["ended_at"]
            next_dispatch.append(gap)
            by_step[k].append(gap)
        in_step.extend(a["ended_at"] - a["started_at"] for a in normal)
        finish.append(d["time_end"] - normal[-1]["ended_at"])

    window = None
    if ok:
        window = max(d["time_end"] for d in ok) - min(d["time_create"] for d in docs)
    return {
        "statuses": statuses,
        "succeeded": len(ok),
        "stopped": len(done),
        "window_seconds": round(window, 3) if window else None,
        "flows_per_s": round(len(ok) / window, 1) if window and len(ok) == len(docs) else None,
        "submit_to_done_ms": dist_ms(e2e),
        "first_step_dispatch_ms": dist_ms(first_dispatch),
        "step_dispatch_ms": dist_ms(next_dispatch),
        "step_dispatch_by_step_ms": {f"{k}->{k + 1}": dist_ms(v) for k, v in by_step.items()},
        "in_step_ms": dist_ms(in_step),
        "last_step_end_to_task_end_ms": dist_ms(finish),
        "flows_with_extra_attempts": retried,
    }


# --- report --------------------------------------------------------------------------------


def _fmt(d: dict[str, Any]) -> str:
    if not d.get("n"):
        return "n/a"
    return f"p50 {d['p50']:8.2f}  p90 {d['p90']:8.2f}  p99 {d['p99']:8.2f}  max {d['max']:8.2f}  mean {d['mean']:8.2f}  (n={d['n']})"


def print_report(summary: dict[str, Any]) -> None:
    m, r, cfg = summary["machine"], summary["results"], summary["config"]
    print("=" * 78)
    print("Asyncflow end-to-end benchmark: 3-step no-op flows (tests/support/flows.yaml `noop`)")
    print("=" * 78)
    print(f"machine   : {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB RAM")
    print(f"os        : {m['os']}, kernel {m['kernel']}; Python {m['python']}")
    print(f"load avg  : {m['loadavg_at_start']} at start (1/5/15 min)")
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    print(f"backend   : {cfg['backend']} ({versions})")
    for note in summary["notes"]:
        print(f"            {note}")
    mode = f"latency, {cfg['rate']:g} flows/s open loop" if cfg["rate"] else f"throughput, {cfg['clients']} HTTP clients"
    print(f"run       : {cfg['flows']} flows, mode {mode}, worker `alpha beta -c {cfg['concurrency']}`")
    if cfg["extra_env"]:
        print(f"extra env : {' '.join(cfg['extra_env'])}")
    print(f"warm-up   : 1 flow, {summary['warmup_ms']:.1f} ms submit->done")
    print()
    s = summary["submit"]
    print(f"submitted : {s['accepted']} accepted, {s['errors']} errors in {s['seconds']:.3f} s"
          f" = {s['per_s']:.1f} submits/s")
    print(f"POST latency (ms)           {_fmt(s['post_ms'])}")
    if cfg["rate"]:
        print(f"schedule lag (ms)           {_fmt(s['schedule_lag_ms'])}")
    print(f"outcome   : {r['statuses']}{'  TIMED OUT' if summary['timed_out'] else ''}")
    if r["flows_per_s"] is not None:
        label = "completed " if cfg["rate"] else "throughput"
        print(f"{label}: {r['flows_per_s']:.1f} flows/s  ({r['succeeded']} flows, first time_create -> "
              f"last time_end = {r['window_seconds']:.3f} s; client wall {summary['client_wall_seconds']:.3f} s)"
              + ("  [bounded by the offered rate]" if cfg["rate"] else ""))
    print()
    print("latencies in ms, server timestamps (task document and its attempt log):")
    print(f"  submit->done (time_end - time_create)   {_fmt(r['submit_to_done_ms'])}")
    print(f"  first-step dispatch (create->started)   {_fmt(r['first_step_dispatch_ms'])}")
    print(f"  step dispatch (prev ended->started)     {_fmt(r['step_dispatch_ms'])}")
    for k, d in r["step_dispatch_by_step_ms"].items():
        print(f"    step {k:<34}{_fmt(d)}")
    print(f"  in step (started->ended, no-op handler) {_fmt(r['in_step_ms'])}")
    print(f"  last step ended -> task time_end        {_fmt(r['last_step_end_to_task_end_ms'])}")
    if r["flows_with_extra_attempts"]:
        print(f"  ({r['flows_with_extra_attempts']} flows had extra attempts; left out of the step figures)")
    c = summary.get("cpu")
    if c:
        print()
        print(f"CPU during the run ({c['window_seconds']:.2f} s window, {m['cpus']} CPUs = "
              f"{c['window_seconds'] * m['cpus']:.2f} CPU-s available):")
        for key, secs in c["by_process"].items():
            print(f"  {key:<10} {secs:7.2f} CPU-s  {c['per_flow_ms'][key]:6.2f} ms/flow")
        print(f"  {'others':<10} {c['others_seconds']:7.2f} CPU-s  (database/broker servers, this script, "
              f"anything else on the machine)")
        print(f"  machine busy {c['machine_busy_pct']:.0f}%")
    print()
    print("-" * 78)
    print("Reference figures QUOTED FROM SPEC.md §12 (not measured by this run; spec machine:")
    print("2 cores with PostgreSQL and RabbitMQ on it):")
    print("  target: 3-step no-op flows end to end, durable   >= 400 flows/s")
    print("  target: at 50 flows/s, submit->done              p50 <= 15 ms")
    print("  target: per-step dispatch overhead               p50 <= 5 ms, p99 <= 50 ms")
    print("  peer:   Celery chain on RabbitMQ, no durable state            334 flows/s")
    print("  peer:   Celery chain + one PostgreSQL update per step         270 flows/s, p50 7 ms at 50/s")
    print("  peer:   DBOS                                                  76-124 flows/s, p50 11-24 ms at 50/s")
    print("-" * 78)
