#!/usr/bin/env python3
"""Quick flows beside a long step: what a consumer process in a long handler holds back.

Starts the stack of ``e2e_flows.py`` (api, scheduler, ``worker alpha beta -c N``),
submits one ``long`` flow whose step works until a file exists, waits for that
step to run, then submits ``--flows`` three-step no-op flows at ``--rate`` flows/s
while it still runs. Once they have all ended, or after ``--hold`` seconds, the
file is made and the long step ends. It prints the quick flows' submit->done
latency: a quick flow whose delivery waits behind the long handler ends only when
the file is made, or when the requeue sweep publishes its step again
(``ASYNCFLOW_REQUEUE_AFTER``, 30 s by default).

With ``ASYNCFLOW_WORKER_PREFETCH`` above 1 (``--env``), a consumer process holds
several deliveries; this is the price of that, measured.

    .venv/bin/python benchmarks/long_step.py --backend postgres-rabbitmq --env ASYNCFLOW_WORKER_PREFETCH=8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_flows import add_stack_options, fetch_docs, parsed, ready_stack  # noqa: E402
from figures import STOPPED, SUCCESS, dist_ms  # noqa: E402
from runner import Run, guarded, run_parser, submit_at_rate, wait_for  # noqa: E402
from stack import SetupError, Stack, log, machine_info  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = run_parser(__doc__, ["postgres-rabbitmq", "postgres-redis"], "postgres-rabbitmq",
                   "HTTP clients for the quick flows (default 4)")
    p.set_defaults(flows=200, rate=50.0)
    p.add_argument("--hold", type=float, default=45, help="seconds the long step runs at most (default 45)")
    add_stack_options(p)
    return parsed(p, argv)


def until(condition: Callable[[], bool], stack: Stack, seconds: float) -> bool:
    return wait_for(condition, stack.check_alive, time.monotonic() + seconds, poll=0.05)


def bench(args: argparse.Namespace, run: Run) -> int:
    machine = machine_info()
    _backend, stack, api, _warm = ready_stack(args, run)

    gate = run.home / "long-step-ends"
    long_id = uuid.uuid4().hex
    body = {"flow": "long", "parameters": {"wait_for_file": {"0": str(gate)}}, "task_id": long_id}
    status, answer = api.http.call("POST", "/api/tasks", body, repeatable=True)
    if status not in (200, 201):
        raise SetupError(f"the long flow's submit answered {status}: {answer}")
    # Its start is stored before its handler runs, or (ASYNCFLOW_RECORD_START_AFTER) that long after.
    if not until(lambda: (api.get(long_id)["current"] or {}).get("phase") == "running", stack, 60):
        raise SetupError("the long step did not start")
    log(f"long step running; submitting {args.flows} quick flows at {args.rate:g}/s")

    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    sub = submit_at_rate(lambda _i: api.submit(run_id), args.flows, args.rate, args.clients,
                         time.monotonic() + args.timeout)
    all_ended = until(lambda: api.all_stopped(run_id), stack, args.hold)
    gate.touch()
    if not until(lambda: api.get(long_id)["task_status"] in STOPPED, stack, 60):
        raise SetupError("the long step did not end once its file was made")
    if not all_ended and not until(lambda: api.all_stopped(run_id), stack, args.timeout):
        raise SetupError("quick flows still running after the long step ended")

    docs = fetch_docs(api, sub.ids)
    done = [d["time_end"] - d["time_create"] for d in docs if d["task_status"] == SUCCESS]
    summary: dict[str, Any] = {
        "bench": "long_step",
        "backend": args.backend,
        "machine": machine,
        "env": args.extra_env,
        "concurrency": args.concurrency,
        "flows": len(docs),
        "succeeded": len(done),
        "rate": args.rate,
        "ended_before_the_long_step": all_ended,
        "submit_to_done_ms": dist_ms(done),
        "over_1s": sum(seconds > 1 for seconds in done),
    }
    d = summary["submit_to_done_ms"]
    print(f"machine: {machine}")
    print(f"{args.backend}, {' '.join(args.extra_env) or 'default settings'}, {args.concurrency} consumer processes")
    print(f"{len(done)} of {len(docs)} quick flows succeeded; all ended while the long step ran: {all_ended}")
    print(f"submit->done ms: p50 {d.get('p50')}, p90 {d.get('p90')}, p99 {d.get('p99')}, max {d.get('max')}; "
          f"over 1 s: {summary['over_1s']}")
    print("RESULT " + json.dumps(summary))
    return 0 if len(done) == len(docs) else 1


def main(argv: list[str] | None = None) -> int:
    return guarded(parse_args(argv), bench, "af_long_", "a process died", "process logs")


if __name__ == "__main__":
    sys.exit(main())
