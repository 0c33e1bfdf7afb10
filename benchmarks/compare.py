#!/usr/bin/env python
"""Asyncflow against its peer, a plain Celery chain with one PostgreSQL UPDATE per step.

Runs ``e2e_flows.py`` and ``celery_chain.py`` alternately, as subprocesses of this
Python, for ``--rounds`` rounds. Each round runs, in this order:

    asyncflow burst (--flows N), peer burst (--flows N),
    asyncflow at --rate R (--rate-flows M flows), peer at --rate R (M flows)

Each run sets up and removes its own database and RabbitMQ vhost. The figures are
read from the ``RESULT {json}`` line each script prints last. It prints a table
per round, the median of each figure over the rounds, and the ratios
Asyncflow / peer of burst flows/s and of submit->done p50 at rate R, and peer /
Asyncflow of the burst's CPU per flow of all that serves a flow (each side's own
processes and the database and broker servers; the peer's submits, which run in
its script, included; the load generator not). The peer's burst leaves part of
the machine idle, so the last ratio tells how much cheaper a flow is, the first
what that buys in throughput on this machine.

The exit status is 0 when every run exited 0, 1 otherwise, 130 when interrupted.

    .venv/bin/python benchmarks/compare.py --backend postgres-rabbitmq --rounds 2
    .venv/bin/python benchmarks/compare.py --flows 500 --rate 50 --rate-flows 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from stack import REPO, log, machine_info  # noqa: E402

SCRIPTS = {"asyncflow": BENCH_DIR / "e2e_flows.py", "peer": BENCH_DIR / "celery_chain.py"}
LABELS = {"asyncflow": "asyncflow", "peer": "celery chain"}


class Interrupted(Exception):
    pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["postgres-rabbitmq"], default="postgres-rabbitmq")
    p.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    p.add_argument("--flows", type=int, default=500, help="flows per burst run (default 500)")
    p.add_argument("--rate", type=float, default=50, help="flows/s of the latency runs (default 50)")
    p.add_argument("--rate-flows", type=int, default=200, help="flows per latency run (default 200)")
    p.add_argument("--concurrency", type=int, default=2, help="worker pool processes, both sides (default 2)")
    p.add_argument("--clients", type=int, default=4, help="submitting clients, both sides (default 4)")
    p.add_argument("--timeout", type=float, default=600, help="--timeout of each run (default 600)")
    p.add_argument("--pause", type=float, default=5, help="seconds between runs (default 5)")
    p.add_argument("--log-dir", type=Path, default=None, help="save each run's stdout here")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also run Asyncflow with these settings in every round, e.g. "
                        "one-commit:ASYNCFLOW_RECORD_START_AFTER=1 (repeatable)")
    args = p.parse_args(argv)
    if min(args.rounds, args.flows, args.rate_flows, args.concurrency, args.clients) < 1 or args.rate <= 0:
        p.error("--rounds, --flows, --rate, --rate-flows, --concurrency and --clients must be positive")
    return args


def variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """Extra Asyncflow sides: name -> KEY=VALUE settings for its processes."""
    found = {}
    for spec in args.variant:
        name, _, settings = spec.partition(":")
        if not name or name in SCRIPTS or not all("=" in kv for kv in settings.split(",")):
            raise SystemExit(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
        found[name] = settings.split(",")
    return found


def command(args: argparse.Namespace, side: str, mode: str) -> list[str]:
    extra = variants(args).get(side)
    script = SCRIPTS["asyncflow"] if extra is not None else SCRIPTS[side]
    cmd = [sys.executable, str(script), "--backend", args.backend,
           "--concurrency", str(args.concurrency), "--clients", str(args.clients), "--timeout", str(args.timeout)]
    for kv in extra or []:
        cmd += ["--env", kv]
    if mode == "burst":
        return [*cmd, "--flows", str(args.flows)]
    return [*cmd, "--rate", f"{args.rate:g}", "--flows", str(args.rate_flows)]


def run_one(cmd: list[str], log_file: Path | None) -> dict[str, Any]:
    """Run one benchmark; its progress goes to our stderr, its stdout is parsed for RESULT."""
    log("running " + " ".join([Path(cmd[1]).name, *cmd[2:]]))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate()
    except BaseException:
        # Let the run clean up after itself (its database, vhost and processes).
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    if log_file is not None:
        log_file.write_text(out)
    result: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            try:
                result = json.loads(line[len("RESULT "):])
            except ValueError:
                result = {}
    result["returncode"] = proc.returncode
    if proc.returncode == 130:
        raise Interrupted
    if proc.returncode != 0:
        log(f"run exited with {proc.returncode}" + ("" if "flows" in result else " and printed no RESULT line"))
    return result


def per_flow_ms(r: dict[str, Any], secs: float | None) -> float | None:
    """``secs`` of CPU per flow the run completed, in ms; None if either is unknown."""
    if secs is None or not r.get("succeeded"):
        return None
    return 1000 * secs / r["succeeded"]


def stack_cpu_ms(r: dict[str, Any]) -> float | None:
    """CPU per flow of the stack's own processes (Asyncflow: api+scheduler+worker; peer: worker)."""
    if not r.get("cpu_s"):
        return None
    return per_flow_ms(r, sum(r["cpu_s"].values()))


def flow_cost_ms(r: dict[str, Any]) -> float | None:
    """CPU per flow of all that serves a flow: the stack's processes, the database and broker servers,
    and the peer's submits (its script's INSERT and publish, which Asyncflow's API does); not the load generator."""
    if not r.get("cpu_s"):
        return None
    return per_flow_ms(
        r, sum(r["cpu_s"].values()) + r.get("cpu_script_s", 0.0) + sum((r.get("cpu_servers_s") or {}).values())
    )


def cell(v: Any, width: int, digits: int = 1) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if isinstance(v, float | int) and not isinstance(v, bool):
        return f"{v:>{width}.{digits}f}"
    return f"{v!s:>{width}}"


def server_cpu_ms(r: dict[str, Any], server: str) -> float | None:
    """CPU-ms per flow of the PostgreSQL or RabbitMQ server processes (part of 'others')."""
    return per_flow_ms(r, (r.get("cpu_servers_s") or {}).get(server))


HEADER = (f"{'run':<28}{'flows/s':>9}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}"
          f"{'stack CPU':>11}{'pg':>6}{'mq':>6}{'script':>8}{'others':>9}{'busy':>7}{'load1':>7}{'exit':>6}")
UNITS = (f"{'':<28}{'':>9}{'submit->done':>30}{'ms/flow':>11}{'ms/flow':>20}{'CPU-s':>9}{'%':>7}"
         f"{'':>7}{'':>6}")


def script_cpu_ms(r: dict[str, Any]) -> float | None:
    """CPU per flow of the benchmark script: the chain's submits, or Asyncflow's load generator (part of 'others')."""
    return per_flow_ms(r, r.get("cpu_script_s", r.get("cpu_client_s")))


def row(label: str, r: dict[str, Any], cpu_ms: float | None = None, pg_ms: float | None = None,
        mq_ms: float | None = None, script_ms: float | None = None) -> str:
    load = r.get("loadavg_at_start")
    cpu_ms = stack_cpu_ms(r) if cpu_ms is None else cpu_ms
    pg_ms = server_cpu_ms(r, "postgresql") if pg_ms is None else pg_ms
    mq_ms = server_cpu_ms(r, "rabbitmq") if mq_ms is None else mq_ms
    script_ms = script_cpu_ms(r) if script_ms is None else script_ms
    return (f"{label:<28}{cell(r.get('flows_per_s'), 9)}{cell(r.get('submit_done_p50_ms'), 10)}"
            f"{cell(r.get('submit_done_p95_ms'), 10)}{cell(r.get('submit_done_p99_ms'), 10)}"
            f"{cell(cpu_ms, 11)}{cell(pg_ms, 6)}{cell(mq_ms, 6)}{cell(script_ms, 8)}{cell(r.get('cpu_others_s'), 9, 2)}"
            f"{cell(r.get('machine_busy_pct'), 7, 0)}"
            f"{cell(load[0] if load else None, 7, 2)}{cell(r.get('returncode'), 6, 0)}")


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 2) if vals else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def print_machine(m: dict[str, Any]) -> None:
    print(f"machine   : {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB RAM")
    print(f"os        : {m['os']}, kernel {m['kernel']}; Python {m['python']}")
    print(f"load avg  : {m['loadavg_at_start']} at start (1/5/15 min)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    sides = ["asyncflow", *variants(args), "peer"]
    plan = [(side, mode) for mode in ("burst", "rate") for side in sides]
    rounds: list[dict[tuple[str, str], dict[str, Any]]] = []
    interrupted = False
    try:
        for k in range(1, args.rounds + 1):
            results: dict[tuple[str, str], dict[str, Any]] = {}
            rounds.append(results)
            for side, mode in plan:
                if results or k > 1:
                    time.sleep(args.pause)
                log_file = args.log_dir / f"round{k}-{side}-{mode}.txt" if args.log_dir else None
                results[(side, mode)] = run_one(command(args, side, mode), log_file)
    except (KeyboardInterrupt, Interrupted):
        log("interrupted")
        interrupted = True

    def name(side: str) -> str:
        return LABELS.get(side, f"asyncflow {side}")

    labels = {(side, "burst"): f"{name(side)} burst {args.flows}" for side in sides}
    labels |= {(side, "rate"): f"{name(side)} {args.rate:g}/s x{args.rate_flows}" for side in sides}
    print("=" * 101)
    print("Asyncflow vs a Celery chain (3 no-op steps; peer: one PostgreSQL UPDATE per step)")
    print("=" * 101)
    print_machine(machine)
    print(f"runs      : --backend {args.backend}, worker -c {args.concurrency}, {args.clients} clients; "
          f"burst {args.flows} flows; latency {args.rate:g} flows/s x {args.rate_flows} flows; "
          f"{args.rounds} round(s), alternating")
    print("stack CPU : CPU of the stack's own process trees per flow (asyncflow: api + scheduler + worker;")
    print("            celery chain: worker; its submitter's INSERT + publish run in the script, in 'others')")
    print("pg, mq    : CPU per flow of the PostgreSQL and RabbitMQ server processes (part of 'others')")
    print("script    : CPU per flow of the benchmark script (part of 'others'): the chain's submits, counted as")
    print("            its intake; Asyncflow's load generator (HTTP clients), no part of either stack")
    print("others    : CPU-s of everything else on the machine during the run (PostgreSQL, RabbitMQ,")
    print("            the benchmark script, other users)")
    for k, results in enumerate(rounds, 1):
        print()
        print(f"round {k}")
        print(HEADER)
        print(UNITS)
        for key in plan:
            if key in results:
                print(row(labels[key], results[key]))

    def med(key: tuple[str, str], field: str) -> float | None:
        return median([r[key].get(field) for r in rounds if key in r])

    print()
    print(f"median over {len(rounds)} round(s)")
    print(HEADER)
    for key in plan:
        rs = [r[key] for r in rounds if key in r]
        if rs:
            merged: dict[str, Any] = {
                f: median([x.get(f) for x in rs])
                for f in ("flows_per_s", "submit_done_p50_ms", "submit_done_p95_ms", "submit_done_p99_ms",
                          "cpu_others_s", "machine_busy_pct")
            }
            print(row(labels[key], merged, median([stack_cpu_ms(x) for x in rs]),
                      median([server_cpu_ms(x, "postgresql") for x in rs]),
                      median([server_cpu_ms(x, "rabbitmq") for x in rs]),
                      median([script_cpu_ms(x) for x in rs])))

    burst_peer, p50_peer = med(("peer", "burst"), "flows_per_s"), med(("peer", "rate"), "submit_done_p50_ms")
    burst_af, p50_af = med(("asyncflow", "burst"), "flows_per_s"), med(("asyncflow", "rate"), "submit_done_p50_ms")
    for side in sides[:-1]:
        print()
        print(f"ratio {name(side)} / celery chain (medians; per round in brackets)")
        per_round_burst = [ratio(r.get((side, "burst"), {}).get("flows_per_s"),
                                 r.get(("peer", "burst"), {}).get("flows_per_s")) for r in rounds]
        per_round_p50 = [ratio(r.get((side, "rate"), {}).get("submit_done_p50_ms"),
                               r.get(("peer", "rate"), {}).get("submit_done_p50_ms")) for r in rounds]
        per_round_cost = [ratio(flow_cost_ms(r[("peer", "burst")]), flow_cost_ms(r[(side, "burst")]))
                          if (side, "burst") in r and ("peer", "burst") in r else "-" for r in rounds]
        burst_side, p50_side = med((side, "burst"), "flows_per_s"), med((side, "rate"), "submit_done_p50_ms")
        cost_side = median([flow_cost_ms(r[(side, "burst")]) for r in rounds if (side, "burst") in r])
        cost_peer = median([flow_cost_ms(r[("peer", "burst")]) for r in rounds if ("peer", "burst") in r])
        print(f"  {f'burst flows/s ({args.flows} flows)':<40}{ratio(burst_side, burst_peer):>6}  "
              f"[{', '.join(per_round_burst)}]  (above 1: asyncflow faster)")
        print(f"  {f'submit->done p50 at {args.rate:g} flows/s':<40}{ratio(p50_side, p50_peer):>6}  "
              f"[{', '.join(per_round_p50)}]  (above 1: asyncflow slower)")
        print(f"  {'burst CPU per flow, all that serves it':<40}{ratio(cost_peer, cost_side):>6}  "
              f"[{', '.join(per_round_cost)}]  (above 1: asyncflow cheaper; {cost_side} against {cost_peer} ms)")

    failed = [(k, key) for k, r in enumerate(rounds, 1) for key in r if r[key].get("returncode") != 0]
    for k, key in failed:
        print(f"  round {k}, {labels[key]}: exit {rounds[k - 1][key].get('returncode')}; "
              f"its figures are not comparable")
    summary = {
        "machine": machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rounds": [{f"{side}_{mode}": r[(side, mode)] for side, mode in plan if (side, mode) in r} for r in rounds],
        "median": {"asyncflow_burst_flows_per_s": burst_af, "peer_burst_flows_per_s": burst_peer,
                   "asyncflow_rate_p50_ms": p50_af, "peer_rate_p50_ms": p50_peer},
    }
    print("SUMMARY " + json.dumps(summary, sort_keys=True), flush=True)
    if interrupted:
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
