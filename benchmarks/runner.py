"""How a flow benchmark runs: its common options, the submitting loops, the measured window, and the
exit status, shared by e2e_flows.py and celery_chain.py.

Both submit N flows, either as fast as ``--clients`` threads can (burst) or at ``--rate`` flows/s
(open loop), wait until every submitted flow is done, and account for the CPU used meanwhile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stack import Processes, SetupError, log, machine_cpu, servers_cpu

# Submits flow number i; returns (its id, seconds the submit took).
Send = Callable[[int], tuple[str, float]]


# --- options -------------------------------------------------------------------------------


def run_parser(doc: str | None, backends: list[str], default_backend: str,
               clients_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=backends, default=default_backend)
    p.add_argument("--flows", type=int, default=500, help="flows to run (default 500)")
    p.add_argument("--concurrency", type=int, default=2, help="worker pool processes (default 2)")
    p.add_argument("--rate", type=float, default=None, help="latency mode: submit at this many flows/s")
    p.add_argument("--clients", type=int, default=4, help=clients_help)
    p.add_argument("--timeout", type=float, default=600, help="seconds for submitting and finishing (default 600)")
    return p


def add_keep_options(p: argparse.ArgumentParser, kept: str) -> None:
    p.add_argument("--keep", action="store_true", help=f"keep the temp dir ({kept}) even on success")
    p.add_argument("--postgres-admin-url", default=None,
                   help="libpq URL to create/drop the database (default postgres@ then root@127.0.0.1:5432)")


def check_positive(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.flows < 1 or args.concurrency < 1 or args.clients < 1 or (args.rate is not None and args.rate <= 0):
        p.error("--flows, --concurrency, --clients and --rate must be positive")


@contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGINT too: a shell that starts us in the background may have set it to "ignore".
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


# --- submitting ----------------------------------------------------------------------------


@dataclass
class Submitted:
    ids: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # each submit, as the client saw it
    errors: list[str] = field(default_factory=list)
    first_start: float = 0.0  # perf_counter
    last_end: float = 0.0
    schedule_lag: list[float] = field(default_factory=list)  # latency mode: send time - planned time
    lock: threading.Lock = field(default_factory=threading.Lock)

    def one(self, send: Send, i: int) -> None:
        try:
            flow_id, secs = send(i)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            with self.lock:
                self.errors.append(repr(exc))
            return
        with self.lock:
            self.ids.append(flow_id)
            self.seconds.append(secs)
            self.last_end = max(self.last_end, time.perf_counter())


def submit_burst(send: Send, n: int, clients: int, deadline: float) -> Submitted:
    out = Submitted()
    counter = iter(range(n))
    counter_lock = threading.Lock()

    def client_loop() -> None:
        while time.monotonic() < deadline:
            with counter_lock:
                i = next(counter, None)
            if i is None:
                return
            out.one(send, i)

    out.first_start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def submit_at_rate(send: Send, n: int, rate: float, clients: int, deadline: float) -> Submitted:
    """Open loop: flow i leaves at t0 + i/rate whatever happened to the others."""
    out = Submitted()
    interval = 1.0 / rate

    def one(i: int, planned: float) -> None:
        out.schedule_lag.append(time.perf_counter() - planned)
        out.one(send, i)

    with ThreadPoolExecutor(max_workers=max(clients, 8)) as pool:
        t0 = out.first_start = time.perf_counter()
        for i in range(n):
            planned = t0 + i * interval
            delay = planned - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() > deadline:
                break
            pool.submit(one, i, planned)
    return out


def wait_for(finished: Callable[[], bool], check_alive: Callable[[], None], deadline: float,
             poll: float = 0.1) -> bool:
    last_note = time.monotonic()
    while time.monotonic() < deadline:
        check_alive()
        if finished():
            return True
        if time.monotonic() - last_note > 10:
            log("waiting for the flows to finish...")
            last_note = time.monotonic()
        time.sleep(poll)
    return False


# --- the measured window -------------------------------------------------------------------


@dataclass
class Measured:
    sub: Submitted
    wall: float  # client seconds from the first submit until every flow was seen done
    timed_out: bool
    cpu: dict[str, float]  # CPU seconds of each process tree, rounded to 0.01
    script_cpu: float  # CPU seconds of this script
    busy: float  # CPU seconds the whole machine was busy
    total: float  # CPU seconds the whole machine had
    servers: dict[str, float]  # CPU seconds of the database and broker servers (in "others")
    # Resident MiB of each process tree at the start, halfway through the window and at the end: a
    # working set filled in a run's first seconds shows from the start, a leak in the second half too.
    rss: dict[str, tuple[float, float, float]]


class RssSamples:
    """Each process tree's resident memory, read once a second on a thread of its own."""

    def __init__(self, procs: Processes) -> None:
        self._procs = procs
        self._samples: list[tuple[float, dict[str, float]]] = [(time.monotonic(), procs.rss())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._samples.append((time.monotonic(), self._procs.rss()))

    def stop(self) -> dict[str, tuple[float, float, float]]:
        self._stop.set()
        self._thread.join()
        end = self._procs.rss()
        first_at, first = self._samples[0]
        half = first_at + (time.monotonic() - first_at) / 2
        _, middle = min(self._samples, key=lambda sample: abs(sample[0] - half))
        return {k: (v, middle.get(k, 0.0), end.get(k, 0.0)) for k, v in first.items()}


def measure(args: argparse.Namespace, procs: Processes, send: Send, finished: Callable[[Submitted], bool],
            clients: str) -> Measured:
    """Submit ``args.flows`` flows in the mode ``args`` asks for and wait until ``finished``."""
    deadline = time.monotonic() + args.timeout
    cpu0, script0, machine0, servers0 = procs.cpu(), sum(os.times()[:2]), machine_cpu(), servers_cpu()
    rss = RssSamples(procs)
    t0 = time.perf_counter()
    if args.rate:
        log(f"submitting {args.flows} flows at {args.rate:g}/s")
        sub = submit_at_rate(send, args.flows, args.rate, args.clients, deadline)
    else:
        log(f"submitting {args.flows} flows with {args.clients} {clients}")
        sub = submit_burst(send, args.flows, args.clients, deadline)
    log(f"{len(sub.ids)} submitted in {sub.last_end - sub.first_start:.2f} s; waiting for them")
    done = wait_for(lambda: finished(sub), procs.check_alive, deadline)
    wall = time.perf_counter() - t0
    cpu1, script1, machine1, servers1 = procs.cpu(), sum(os.times()[:2]), machine_cpu(), servers_cpu()
    timed_out = not done or len(sub.ids) + len(sub.errors) < args.flows
    if timed_out:
        log(f"timed out after {args.timeout:g} s")
    procs.check_alive()
    return Measured(
        sub=sub, wall=wall, timed_out=timed_out,
        cpu={k: round(cpu1[k] - cpu0[k], 2) for k in cpu0},
        script_cpu=script1 - script0,
        busy=machine1[0] - machine0[0], total=machine1[1] - machine0[1],
        servers={k: round(servers1[k] - servers0[k], 2) for k in servers0},
        rss=rss.stop(),
    )


# --- setting up and tearing down -----------------------------------------------------------


class Run:
    """A run's temp dir, what to undo at its end (last set up, first undone), and its processes."""

    def __init__(self, prefix: str) -> None:
        self.home = Path(tempfile.mkdtemp(prefix=prefix))
        self.exits = ExitStack()
        self.procs: Processes | None = None

    def stop_at_end(self, procs: Processes, what: str) -> None:
        self.procs = procs

        def stop() -> None:
            log(f"stopping the {what}")
            t_stop = time.monotonic()
            procs.stop()
            log(f"stopped in {time.monotonic() - t_stop:.1f} s")

        self.exits.callback(stop)


def guarded(args: argparse.Namespace, bench: Callable[[argparse.Namespace, Run], int], prefix: str, died: str,
            kept: str) -> int:
    """Run ``bench``, turn a failure into exit status 3 (130 when interrupted), and undo what it set up.

    The temp dir is kept, and its place logged, when the run did not exit 0 or ``--keep`` asks for it.
    """
    with interrupt_on_sigterm():
        run = Run(prefix)
        keep = args.keep
        try:
            status = bench(args, run)
            keep = keep or status != 0
            return status
        except SetupError as exc:
            log(f"setup failed or {died}: {exc}")
            keep = True
            return 3
        except Exception as exc:  # noqa: BLE001 - report, clean up, and say where the logs are
            log(f"benchmark failed: {exc!r}")
            if run.procs is not None:
                run.procs.log_exited()
            keep = True
            return 3
        except KeyboardInterrupt:
            log("interrupted")
            keep = True
            return 130
        finally:
            run.exits.close()
            if keep:
                log(f"{kept} kept in {run.home}")
            else:
                shutil.rmtree(run.home, ignore_errors=True)
