"""How many GPUs one router keeps fed, without GPUs: the router alone with fake workers.

For each fleet size N it starts the real router role process (as `launch` does, over
`ipc://` in a temporary directory), fills its queue with long sequences, and lets N fake
workers (`fake_fleet`, in a few processes) ask for batches, "run" each step in T ms and
report one token per row. After a warm-up it measures a window: rows per second that came
back, the router's CPU (from /proc), the fakes' CPU, and how busy the fake devices were.
The fleet scales linearly while N workers give >= 90% of N x the single-worker figure.

Run: `python -m benchmarks.router --workers 32 --step-ms 2 [--batch 256] [--window-s 3]
[--warmup-s 1] [--router-setting KEY=VALUE ...] [--json out.json]`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import module_command
from qmigrate.wire import protocol as P

LINEAR = 0.9
PROMPT_LEN = 16
MAX_NEW_TOKENS = 1 << 30      # nothing finishes within a run: the router's steady state
WORKERS_PER_PROCESS = 8


@dataclass(slots=True)
class FleetPoint:
    num_workers: int
    rows_per_s: float             # row-steps the fleet completed per second
    ideal_rows_per_s: float       # N x batch / step time
    leases_per_s: float
    mean_rows_per_lease: float
    device_busy: float            # mean fraction of the window the fake devices were running steps
    router_cpu: float             # cores the router process used in the window
    fakes_cpu: float              # cores the fake worker processes used
    num_fake_procs: int
    scaling: float = 0.0          # rows_per_s / (N x the single-worker rows_per_s)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sweep_sizes(text: str) -> list[int]:
    """"1,2,4" as given; one number N: the powers of two up to N, and N."""
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--workers: expected N or a list like 1,2,4, got {text!r}")
    if len(sizes) == 1:
        n = sizes[0]
        sizes = sorted({2 ** k for k in range(n.bit_length()) if 2 ** k <= n} | {n})
    if sizes[0] != 1:
        sizes = [1] + sizes   # the single-worker figure is what scaling is measured against
    return sorted(set(sizes))


def run_fleet(num_workers: int, step_ms: float, batch: int, *, warmup_s: float, window_s: float,
              num_procs: int, router_overrides: dict, log_level: str) -> FleetPoint:
    from qmigrate.config import dump_topology, parse_topology
    from qmigrate.launch import start_roles, stop, wait_for_fleet

    target = num_workers * batch * 2 + batch   # every worker can always fill both batches in flight
    with tempfile.TemporaryDirectory(prefix="qm-rb-") as tmp:
        names = [f"f{i}" for i in range(1, num_workers + 1)]
        topo = parse_topology({
            "transport": "ipc", "ipc_dir": tmp, "nodes": [{"name": "local"}],
            "router": {"node": "local", "max_queued": target + batch, **router_overrides},
            "ingest": {"node": "local"}, "detokenizer": {"node": "local"},
            "workers": [{"name": n, "node": "local", "max_num_seqs": batch} for n in names],
        }, source="router bench")
        path = Path(tmp) / "topology.yaml"
        dump_topology(topo, path)
        endpoint = topo.endpoint("router").connect
        children = start_roles(topo, path, [("router", "router")], read_stdin=False, log_level=log_level)
        router_pid = children[0].proc.pid
        fakes: list[subprocess.Popen] = []
        feeder = None
        try:
            if not wait_for_fleet(topo, children, 0, timeout_s=60):
                raise RuntimeError("the router did not start")
            feeder = Feeder(endpoint, target)
            feeder.top_up()
            groups = [names[i::num_procs] for i in range(num_procs)]
            commands = [module_command("fake_fleet", endpoint, *group, "--step-ms", str(step_ms),
                                       "--max-seqs", str(batch)) for group in groups if group]
            fakes = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for argv, env in commands]
            if not wait_for_fleet(topo, children, num_workers, timeout_s=60):
                raise RuntimeError("the fake workers did not join")
            feeder.run_for(warmup_s)
            t0, cpu0 = time.monotonic(), [cpu_seconds(router_pid)] + [cpu_seconds(p.pid) for p in fakes]
            feeder.run_for(window_s)
            t1, cpu1 = time.monotonic(), [cpu_seconds(router_pid)] + [cpu_seconds(p.pid) for p in fakes]
            stop(children)  # first, so that it does not log every lease to a fake that left
            done = _collect(fakes)
        finally:
            if feeder is not None:
                feeder.sock.close(linger=0)
            stop(children)
            for p in fakes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                p.stdout.close()
    window = t1 - t0
    # A lease counts for the part of its run inside the window, rows pro rata.
    rows = leases = busy = rows_in_leases = 0.0
    for completions in done.values():
        for start, end, num_rows, num_tokens in completions:
            span = end - start
            inside = max(0.0, min(end, t1) - max(start, t0))
            if inside <= 0 or span <= 0:
                continue
            share = inside / span
            rows += num_tokens * share
            leases += share
            rows_in_leases += num_rows * share
            busy += inside
    return FleetPoint(num_workers, rows / window, num_workers * batch / (step_ms / 1000), leases / window,
                      rows_in_leases / leases if leases else 0.0, busy / (window * num_workers),
                      (cpu1[0] - cpu0[0]) / window, (sum(cpu1[1:]) - sum(cpu0[1:])) / window, len(fakes))


class Feeder:
    """Keeps `target` long sequences live at the router, as ingest would with endless input."""

    def __init__(self, endpoint: str, target: int):
        import zmq
        from qmigrate.wire import transport
        self.endpoint, self.target = endpoint, target
        self.sock = transport.socket(zmq.DEALER, connect=endpoint, identity="router-bench-feeder")
        self.next_id = 1

    def top_up(self) -> None:
        from qmigrate.wire import transport
        stats = transport.request(self.endpoint, P.StatsRequest(), timeout_s=5.0, expect=P.Stats).counters
        missing = self.target - stats.get("live", 0)
        while missing > 0:
            n = min(missing, 256)
            specs = [P.SeqSpec(self.next_id + i, P.pack_i32([10 + (self.next_id + i + k) % 900
                                                             for k in range(PROMPT_LEN)]),
                               PROMPT_LEN, MAX_NEW_TOKENS) for i in range(n)]
            transport.send(self.sock, P.Submit(specs))
            got = transport.recv(self.sock, 5.0)
            if got is None or not isinstance(got[1], P.SubmitAck):
                raise RuntimeError("the router did not acknowledge a submit")
            taken = got[1].num_accepted
            self.next_id += taken
            missing -= taken
            if taken < n:
                break

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(0.5, left))
            self.top_up()


def _collect(fakes: list[subprocess.Popen]) -> dict[str, list]:
    done = {}
    for p in fakes:
        p.terminate()
    for p in fakes:
        out, _ = p.communicate(timeout=30)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"a fake worker process failed (exit status {p.returncode})")
        done.update(json.loads(lines[-1]))
    return done


def format_table(points: list[FleetPoint], step_ms: float, batch: int) -> str:
    lines = [f"fake workers: {batch} rows per {step_ms:g} ms step",
             f"{'N':>4} {'rows/s':>12} {'of ideal':>9} {'scaling':>8} {'rows/lease':>11} "
             f"{'busy':>6} {'router CPU':>11} {'fakes CPU':>10}"]
    for p in points:
        lines.append(f"{p.num_workers:>4} {p.rows_per_s:>12,.0f} {p.rows_per_s / p.ideal_rows_per_s:>9.0%} "
                     f"{p.scaling:>8.0%} {p.mean_rows_per_lease:>11.1f} {p.device_busy:>6.0%} "
                     f"{p.router_cpu:>10.0%} {p.fakes_cpu:>10.0%}")
    largest = largest_linear(points)
    lines.append(f"largest N that scales linearly (>= {LINEAR:.0%} of N x one worker): "
                 + (str(largest) if largest else "none"))
    return "\n".join(lines)


def largest_linear(points: list[FleetPoint]) -> int:
    """The largest N of the sweep such that it and every N below scale at >= LINEAR."""
    largest = 0
    for p in sorted(points, key=lambda p: p.num_workers):
        if p.scaling < LINEAR:
            break
        largest = p.num_workers
    return largest


def run_router_bench(*, sizes: list[int], step_ms: float, batch: int, warmup_s: float, window_s: float,
                     router_overrides: dict, json_path: Path | None, log_level: str = "warning",
                     workers_per_process: int = WORKERS_PER_PROCESS) -> list[FleetPoint]:
    points: list[FleetPoint] = []
    for n in sizes:
        procs = max(1, -(-n // workers_per_process))
        point = run_fleet(n, step_ms, batch, warmup_s=warmup_s, window_s=window_s, num_procs=procs,
                          router_overrides=router_overrides, log_level=log_level)
        single = points[0].rows_per_s if points else point.rows_per_s
        point.scaling = point.rows_per_s / (n * single) if single else 0.0
        points.append(point)
        print(f"  N={n}: {point.rows_per_s:,.0f} rows/s, scaling {point.scaling:.0%}, "
              f"router CPU {point.router_cpu:.0%}", file=sys.stderr)
        if len(points) > 1 and point.rows_per_s < 1.1 * points[-2].rows_per_s:
            break  # the fleet has stopped scaling: a larger N only adds idle workers
    table = format_table(points, step_ms, batch)
    print(table)
    if json_path is not None:
        machine = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
                   "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        report = {"mode": "fake-workers", "step_ms": step_ms, "batch": batch, "warmup_s": warmup_s,
                  "window_s": window_s, "router": router_overrides, "machine": machine,
                  "points": [asdict(p) for p in points],
                  "largest_linear": largest_linear(points), "table": table}
        json_path.write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return points


def main(argv=None) -> None:
    import argparse
    from qmigrate.config import ConfigError, router_settings
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="32", help="N sweeps 1,2,4,... up to N; or a list such as 1,2,4,8,16,32.")
    ap.add_argument("--step-ms", type=float, default=2.0, help="Milliseconds a fake step takes.")
    ap.add_argument("--batch", type=int, default=256, help="Rows per fake step (the workers' max_seqs).")
    ap.add_argument("--window-s", type=float, default=3.0, help="Seconds measured per fleet size, after the warm-up.")
    ap.add_argument("--warmup-s", type=float, default=1.0, help="Seconds of warm-up per fleet size.")
    ap.add_argument("--router-setting", action="append", default=[], metavar="KEY=VALUE",
                    help="For the router section of the run's topology (repeatable), e.g. max_lease_steps=1.")
    ap.add_argument("--json", type=Path, help="Write the results as JSON here.")
    ap.add_argument("--log-level", default="warning")
    a = ap.parse_args(argv)
    try:
        sizes, overrides = sweep_sizes(a.workers), router_settings(a.router_setting)
    except (ValueError, ConfigError) as exc:
        ap.error(str(exc))
    if a.step_ms <= 0 or a.batch < 1 or a.window_s <= 0 or a.warmup_s < 0:
        ap.error("--step-ms and --window-s must be > 0, --batch >= 1, --warmup-s >= 0")
    run_router_bench(sizes=sizes, step_ms=a.step_ms, batch=a.batch, warmup_s=a.warmup_s, window_s=a.window_s,
                     router_overrides=overrides, json_path=a.json, log_level=a.log_level)


if __name__ == "__main__":
    main()
