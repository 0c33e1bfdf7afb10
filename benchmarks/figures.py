"""Figures of a flow benchmark run: distributions, the summary, the report and the ``RESULT`` line.

For Asyncflow every latency comes from the server's timestamps: the task
document's ``time_create`` and ``time_end``, and the ``started_at`` and
``ended_at`` of each attempt in its attempt log. The parts of the summary and of
the report that do not depend on what ran are shared with celery_chain.py.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from shared.states import STOPPED  # success, failed, rollback failed, cancelled

if TYPE_CHECKING:
    from runner import Measured
    from stack import Backend

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


def dist_ms(seconds: list[float], percentiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, Any]:
    ms = [x * 1000 for x in seconds]
    if not ms:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(ms)}
    for p in percentiles:
        out[f"p{p}"] = round(pct(ms, p), 2)
    out["max"] = round(max(ms), 2)
    out["mean"] = round(sum(ms) / len(ms), 2)
    return out


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


# --- summary -------------------------------------------------------------------------------


def summary_head(args: argparse.Namespace, machine: dict[str, Any], backend: Backend, warm: float, m: Measured,
                 submit_key: str, percentiles: tuple[int, ...], **config: Any) -> dict[str, Any]:
    """The summary up to its "submit" part; ``submit_key`` names the distribution of submit times."""
    sub = m.sub
    seconds = sub.last_end - sub.first_start
    return {
        "machine": machine,
        "versions": backend.versions,
        "notes": backend.notes,
        "config": {
            "backend": args.backend, "flows": args.flows, "concurrency": args.concurrency,
            "rate": args.rate, "clients": args.clients, "timeout": args.timeout,
            **config,
        },
        "warmup_ms": round(warm * 1000, 2),
        "timed_out": m.timed_out,
        "client_wall_seconds": round(m.wall, 3),
        "submit": {
            "accepted": len(sub.ids),
            "errors": len(sub.errors),
            "first_errors": sub.errors[:3],
            "seconds": round(seconds, 3),
            "per_s": round(len(sub.ids) / max(seconds, 1e-9), 1),
            submit_key: dist_ms(sub.seconds, percentiles),
            "schedule_lag_ms": dist_ms(sub.schedule_lag, percentiles),
        },
    }


def cpu_figures(m: Measured, per_flow_ms: dict[str, float], submits: bool = False) -> dict[str, Any]:
    """The run's CPU figures. This script's own CPU is reported either way: with ``submits``, it is the
    stack's intake (the chain's INSERT and publish); otherwise the load generator's clients, no part of it."""
    out: dict[str, Any] = {
        "window_seconds": round(m.wall, 3),
        "by_process": m.cpu,
        "per_flow_ms": per_flow_ms,
        "others_seconds": round(m.busy - sum(m.cpu.values()), 2),
        "servers_seconds": m.servers,
        "rss_mib": {k: list(v) for k, v in m.rss.items()},
    }
    out["script_seconds"] = round(m.script_cpu, 2)
    out["script_submits"] = submits
    out["machine_busy_pct"] = round(100 * m.busy / m.total, 1) if m.total else None
    return out


def conclude(bench: str, args: argparse.Namespace, summary: dict[str, Any], m: Measured, succeeded: int,
             done_seconds: list[float]) -> int:
    """The run's exit status, printed with the key figures as one ``RESULT {json}`` line.

    The keys are the same for every bench: compare.py reads them.
    """
    status = 2 if m.timed_out else 1 if m.sub.errors or succeeded != args.flows else 0
    done_ms = [x * 1000 for x in done_seconds]
    r, c = summary["results"], summary["cpu"]
    result = {
        "bench": bench, "backend": args.backend, "mode": "rate" if args.rate else "burst",
        "flows": args.flows, "rate": args.rate, "concurrency": args.concurrency, "clients": args.clients,
        "succeeded": succeeded, "submit_errors": summary["submit"]["errors"],
        "timed_out": summary["timed_out"], "flows_per_s": r["flows_per_s"], "window_s": r["window_seconds"],
        "submits_per_s": summary["submit"]["per_s"],
        **{f"submit_done_p{p}_ms": round(v, 2) if (v := pct(done_ms, p)) is not None else None for p in (50, 95, 99)},
        "cpu_s": c["by_process"], "cpu_per_flow_ms": c["per_flow_ms"], "cpu_others_s": c["others_seconds"],
        "cpu_servers_s": c["servers_seconds"], "rss_mib": c["rss_mib"],
        "machine_busy_pct": c["machine_busy_pct"], "loadavg_at_start": summary["machine"]["loadavg_at_start"],
        "exit_status": status,
    }
    # compare.py counts a submitter's CPU as the stack's, never a load generator's.
    result["cpu_script_s" if c["script_submits"] else "cpu_client_s"] = c["script_seconds"]
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return status


# --- report --------------------------------------------------------------------------------


def fmt(d: dict[str, Any], mid: int = 90) -> str:
    if not d.get("n"):
        return "n/a"
    return (f"p50 {d['p50']:8.2f}  p{mid} {d[f'p{mid}']:8.2f}  p99 {d['p99']:8.2f}  max {d['max']:8.2f}"
            f"  mean {d['mean']:8.2f}  (n={d['n']})")


def print_heading(summary: dict[str, Any], title: str) -> None:
    m, cfg = summary["machine"], summary["config"]
    print("=" * 78)
    print(title)
    print("=" * 78)
    print(f"machine   : {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB RAM")
    print(f"os        : {m['os']}, kernel {m['kernel']}; Python {m['python']}")
    print(f"load avg  : {m['loadavg_at_start']} at start (1/5/15 min)")
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    print(f"backend   : {cfg['backend']} ({versions})")
    for note in summary["notes"]:
        print(f"            {note}")


def print_submits(summary: dict[str, Any], submit_key: str, label: str, width: int, mid: int = 90) -> None:
    s, cfg = summary["submit"], summary["config"]
    print(f"submitted : {s['accepted']} accepted, {s['errors']} errors in {s['seconds']:.3f} s"
          f" = {s['per_s']:.1f} submits/s")
    print(f"{label:<{width}}{fmt(s[submit_key], mid)}")
    if cfg["rate"]:
        print(f"{'schedule lag (ms)':<{width}}{fmt(s['schedule_lag_ms'], mid)}")


def print_outcome(summary: dict[str, Any], outcome: str, succeeded: int, start: str, end: str) -> None:
    """The outcome line, and flows/s over the window from the first ``start`` to the last ``end``."""
    r, cfg = summary["results"], summary["config"]
    print(f"outcome   : {outcome}{'  TIMED OUT' if summary['timed_out'] else ''}")
    if r["flows_per_s"] is not None:
        label = "completed " if cfg["rate"] else "throughput"
        print(f"{label}: {r['flows_per_s']:.1f} flows/s  ({succeeded} flows, first {start} -> "
              f"last {end} = {r['window_seconds']:.3f} s; client wall {summary['client_wall_seconds']:.3f} s)"
              + ("  [bounded by the offered rate]" if cfg["rate"] else ""))


def print_cpu(summary: dict[str, Any]) -> None:
    m, c = summary["machine"], summary["cpu"]
    print()
    print(f"CPU during the run ({c['window_seconds']:.2f} s window, {m['cpus']} CPUs = "
          f"{c['window_seconds'] * m['cpus']:.2f} CPU-s available):")
    for key, secs in c["by_process"].items():
        print(f"  {key:<10} {secs:7.2f} CPU-s  {c['per_flow_ms'][key]:6.2f} ms/flow")
    print(f"  {'others':<10} {c['others_seconds']:7.2f} CPU-s  (database/broker servers, this script, "
          f"anything else on the machine)")
    for server, secs in c["servers_seconds"].items():
        if secs:
            print(f"    of which {server} server processes: {secs:.2f} CPU-s  "
                  f"{1000 * secs / max(summary['config']['flows'], 1):.2f} ms/flow")
    role = "the submitter" if c["script_submits"] else "the load generator's clients, no part of the stack"
    print(f"    of which this script ({role}): {c['script_seconds']:.2f} CPU-s  "
          f"{1000 * c['script_seconds'] / max(summary['config']['flows'], 1):.2f} ms/flow")
    print(f"  machine busy {c['machine_busy_pct']:.0f}%")
    print("Resident memory (MiB, each process tree summed; at the start -> halfway -> at the end):")
    for key, (start, middle, end) in c["rss_mib"].items():
        print(f"  {key:<10} {start:7.1f} -> {middle:7.1f} -> {end:7.1f}  ({_growth(start, end):+.1f} % over the run, "
              f"{_growth(middle, end):+.1f} % over its second half)")


def _growth(before: float, after: float) -> float:
    return 100 * (after - before) / before if before else 0.0


def print_report(summary: dict[str, Any]) -> None:
    r, cfg = summary["results"], summary["config"]
    print_heading(summary, "Asyncflow end-to-end benchmark: 3-step no-op flows (tests/support/flows.yaml `noop`)")
    mode = f"latency, {cfg['rate']:g} flows/s open loop" if cfg["rate"] else f"throughput, {cfg['clients']} HTTP clients"
    print(f"run       : {cfg['flows']} flows, mode {mode}, worker `alpha beta -c {cfg['concurrency']}`")
    if cfg["extra_env"]:
        print(f"extra env : {' '.join(cfg['extra_env'])}")
    print(f"warm-up   : 1 flow, {summary['warmup_ms']:.1f} ms submit->done")
    print()
    print_submits(summary, "post_ms", "POST latency (ms)", 28)
    print_outcome(summary, str(r["statuses"]), r["succeeded"], "time_create", "time_end")
    print()
    print("latencies in ms, server timestamps (task document and its attempt log):")
    print(f"  submit->done (time_end - time_create)   {fmt(r['submit_to_done_ms'])}")
    print(f"  first-step dispatch (create->started)   {fmt(r['first_step_dispatch_ms'])}")
    print(f"  step dispatch (prev ended->started)     {fmt(r['step_dispatch_ms'])}")
    for k, d in r["step_dispatch_by_step_ms"].items():
        print(f"    step {k:<34}{fmt(d)}")
    print(f"  in step (started->ended, no-op handler) {fmt(r['in_step_ms'])}")
    print(f"  last step ended -> task time_end        {fmt(r['last_step_end_to_task_end_ms'])}")
    if r["flows_with_extra_attempts"]:
        print(f"  ({r['flows_with_extra_attempts']} flows had extra attempts; left out of the step figures)")
    if summary.get("cpu"):
        print_cpu(summary)
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
