"""What `benchmarks/four_gpu.py` needs besides its parts: a `qmigrate serve` it starts and
stops, `qmigrate bench serve` and `qmigrate bench` run as commands, the router's queue and
KV pools sampled while they run, and the pure arithmetic over their outputs (the saturating
rate, a drain's pauses and lost calls, a decode step's floor on one GPU's shard, the KV pool
that a burst overflows).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PY = sys.executable


def free_ports(n: int, taken=()) -> int:
    """The first of n consecutive TCP ports on 127.0.0.1 that are free to bind now, none in
    `taken`. Drawn below the kernel's ephemeral range and under the range the test suite
    reserves its ports from: no outgoing connection takes one of these as its source port
    before the server binds it (`serve --metrics-port P` binds P and P + 1)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(2048, low - 12000)
    rng = random.Random()
    for _ in range(1000):
        first = rng.randrange(1024, top - n)
        ports = range(first, first + n)
        if set(ports) & set(taken):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


class Budget:
    """Seconds left of the invocation's wall-time budget; a step that would not fit is skipped."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.skipped: list[str] = []

    @property
    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, what: str, needs_s: float) -> bool:
        if self.left >= needs_s:
            return True
        self.skipped.append(f"{what} (needs ~{needs_s:.0f} s, {max(0.0, self.left):.0f} s left)")
        print(f"four_gpu: skipped {self.skipped[-1]}", file=sys.stderr, flush=True)
        return False


class Server:
    """`qmigrate serve` in a session of its own, its log in a file; `with` waits until it is
    ready and stops it (SIGTERM to the session it leads, then SIGKILL) on the way out."""

    def __init__(self, model: str, log: Path, flags: list[str], *, gpus: str | None = None,
                 ready_timeout_s: float = 300.0):
        self.port = free_ports(1)
        self.metrics_port = free_ports(2, taken=(self.port,))   # the router's, the detokenizer's
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.cmd = [PY, "-m", "qmigrate", "serve", model, "--port", str(self.port),
                    "--metrics-port", str(self.metrics_port), *flags]
        self.log, self.gpus, self.ready_timeout_s = log, gpus, ready_timeout_s
        self.topology: str | None = None
        self.proc = None
        self.started_s = 0.0

    def __enter__(self) -> "Server":
        env = dict(os.environ)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        t0 = time.monotonic()
        print(f"four_gpu: {' '.join(self.cmd[1:])}" + (f" (GPUs {self.gpus})" if self.gpus else ""),
              file=sys.stderr, flush=True)
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        while time.monotonic() - t0 < self.ready_timeout_s:
            text = self.log.read_text(errors="replace")
            if m := re.search(r"qmigrate status (\S+)", text):
                self.topology = m.group(1)
            if re.search(r"^ready:", text, re.M):
                self.started_s = time.monotonic() - t0
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-2000:]
        self.__exit__(None, None, None)
        raise RuntimeError(f"qmigrate serve did not become ready ({self.log}):\n{tail}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)   # the session this process leads
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self.out.close()

    def drain(self, worker: str) -> str:
        out = subprocess.run([PY, "-m", "qmigrate", "drain", self.topology, "--worker", worker],
                             capture_output=True, text=True, timeout=30)
        return (out.stdout + out.stderr).strip()

    def counter(self, name: str) -> float:
        """The sum of a counter's samples on the router's /metrics (0 if it cannot be read)."""
        from qmigrate.bench.serve_metrics import scrape
        try:
            return sum(v for (n, _), v in scrape(self.metrics_url).items() if n == name)
        except (OSError, ValueError):
            return 0.0


def bench_serve(url: str, args: list[str], out: Path, name: str, *, metrics_url: str | None = None,
                timeout_s: float = 600.0, background: bool = False):
    """`qmigrate bench serve` against url; returns its JSON report (or the process, background)."""
    json_path, calls = out / f"{name}.json", out / f"{name}.calls.jsonl"
    cmd = [PY, "-m", "qmigrate", "bench", "serve", "--base-url", url, "--json", str(json_path),
           "--calls-jsonl", str(calls), *args]
    if metrics_url:
        cmd += ["--metrics-url", metrics_url]
    print(f"four_gpu: bench serve {' '.join(args)}", file=sys.stderr, flush=True)
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if background:
        return proc
    return finish_bench(proc, json_path, timeout_s)


def finish_bench(proc, json_path: Path, timeout_s: float = 600.0) -> dict:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if proc.returncode != 0 or not json_path.exists():
        log = json_path.with_suffix(".log")
        raise RuntimeError(f"bench serve failed ({log}):\n{log.read_text(errors='replace')[-2000:]}")
    report = json.loads(json_path.read_text())
    print(report.get("table", ""), file=sys.stderr, flush=True)
    return report


def read_calls(path: Path) -> dict[str, list[dict]]:
    """The calls JSONL of bench serve, by run label."""
    runs: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            call = json.loads(line)
            runs.setdefault(call["rate"], []).append(call)
    return runs


class RouterSampler:
    """The router's queue depth and each worker's free KV blocks, read from /metrics every
    `every_s` while a `with` block runs (queueing and pool pressure, which the counters
    before and after a run do not show)."""

    def __init__(self, metrics_url: str | None, every_s: float = 0.25):
        self.url, self.every_s = metrics_url, every_s
        self.queue: list[float] = []
        self.kv_free_min: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RouterSampler":
        if self.url:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        from qmigrate.bench.serve_metrics import scrape
        while not self._stop.wait(self.every_s):
            try:
                samples = scrape(self.url, timeout_s=2.0)
            except (OSError, ValueError):
                continue
            self.add(samples)

    def add(self, samples: dict) -> None:
        for (name, labels), value in samples.items():
            if name == "qmigrate_queue_depth":
                self.queue.append(value)
            elif name == "qmigrate_kv_blocks_free" and (worker := dict(labels).get("worker")):
                self.kv_free_min[worker] = min(value, self.kv_free_min.get(worker, value))

    def summary(self) -> dict:
        q = sorted(self.queue)
        return {"samples": len(q), "queue_max": q[-1] if q else None,
                "queue_mean": sum(q) / len(q) if q else None, "queue_p90": q[int(0.9 * (len(q) - 1))] if q else None,
                "kv_free_blocks_min": dict(sorted(self.kv_free_min.items()))}


# --- pure arithmetic ---------------------------------------------------------------------

def burst_kv_tokens(per_burst: int, doc_len: int, question_len: int, output_len: str, block_size: int = 16) -> int:
    """A worker's KV pool for the burst workload: half of what one burst holds at its outputs'
    mean length (the shared document once, each request's question and output), in whole
    blocks. Cache-aware placement sends a burst to the worker holding its document, which it
    then overflows twice over, while four such pools hold it with room for the next."""
    lo, hi = (int(x) for x in output_len.split(":"))
    burst = doc_len + per_burst * (question_len + (lo + hi) / 2)
    return int(-(-burst / 2 // block_size) * block_size)



def saturating_rate(calls: list[dict], share_of_tokens: float = 0.8) -> dict:
    """Requests per second the fleet sustains, from a run that sent everything at once: its
    output tok/s until `share_of_tokens` of the tokens had come (the tail of the longest
    outputs, a few rows at a time, left out), over the mean output per request."""
    times = sorted(t for c in calls for t in c["chunks"])
    done = [c for c in calls if not c["error"]]
    if not times or not done:
        raise ValueError("no tokens in the saturating run")
    k = max(1, int(share_of_tokens * len(times)))
    tok_s = k / max(times[k - 1], 1e-9)
    mean_out = sum(c["output_tokens"] for c in done) / len(done)
    return {"tok_per_s": tok_s, "mean_output_tokens": mean_out, "requests_per_s": tok_s / mean_out,
            "whole_run_requests_per_s": len(done) / max(times[-1], 1e-9)}


def drain_effects(calls: list[dict], drain_at: float, before_s: float = 15.0, settle_s: float = 5.0,
                  arrivals_end: float | None = None) -> dict:
    """What a drain at `drain_at` (seconds from the run's start) did, from every call:

    - lost: calls that failed or ended short of their length; repeated: calls that got more
      token events than they asked (a token sent twice);
    - pauses of the streams in flight at the drain (sent before it, last token after it):
      each one's longest gap between tokens that ends after the drain. The drained worker's
      streams are among them (a client cannot tell which), so the largest is a bound on
      theirs; the same figure for the streams in flight `before_s` earlier shows the gaps
      that have nothing to do with the drain;
    - tok/s in the `before_s` before the drain against the time from settle_s after it to
      the end of the arrivals."""
    def pauses(at: float) -> list[float]:
        out = []
        for c in calls:
            ch = c["chunks"]
            if c["start"] < at and ch and ch[-1] > at:
                gaps = [b - a for a, b in zip(ch, ch[1:]) if b > at]
                out.append(max(gaps, default=0.0))
        return sorted(out)

    def tok_s(a: float, b: float) -> float:
        return sum(1 for c in calls for t in c["chunks"] if a <= t < b) / max(b - a, 1e-9)

    def q(xs: list[float], p: float) -> float | None:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    at_drain, control = pauses(drain_at), pauses(max(0.0, drain_at - before_s))
    end = arrivals_end if arrivals_end is not None else max((c["start"] for c in calls), default=drain_at)
    before, after = tok_s(max(0.0, drain_at - before_s), drain_at), tok_s(drain_at + settle_s, max(end, drain_at + settle_s + 1))
    lost = [c for c in calls if c["error"] or (c.get("expected_tokens") and c["output_tokens"] < c["expected_tokens"])]
    repeated = [c for c in calls if c.get("expected_tokens") and
                (len(c["chunks"]) > c["expected_tokens"] or c["output_tokens"] > c["expected_tokens"])]
    return {"drain_at_s": drain_at, "calls": len(calls), "lost": len(lost), "repeated": len(repeated),
            "lost_errors": sorted({c["error"] for c in lost if c["error"]})[:3],
            "streams_in_flight": len(at_drain), "max_pause_s": q(at_drain, 1.0),
            "pause_p90_s": q(at_drain, 0.9), "pause_p75_s": q(at_drain, 0.75),
            "control_max_pause_s": q(control, 1.0), "control_pause_p90_s": q(control, 0.9),
            "tok_per_s_before": before, "tok_per_s_after": after,
            "after_over_before": after / before if before else None}


H100_COPY_BYTES_PER_S = 2.86e12   # docs/benchmarks.md: a device-to-device copy on the H100


def shard_floor_ms(config: dict, tp: int, batch: int, context: int,
                   bandwidth: float = H100_COPY_BYTES_PER_S) -> dict:
    """The decode step's floor on one GPU of a tensor-parallel worker: its share of the
    weights and of every row's KV (1/tp of each), read once at the copy bandwidth."""
    from qmigrate.bench.limits import Shape
    shape = Shape.of(config)
    weights = shape.step_weight_bytes(batch) / tp
    kv = batch * context * shape.kv_bytes_per_token / tp
    return {"weight_bytes_per_gpu": weights, "kv_bytes_per_gpu": kv,
            "floor_ms": (weights + kv) / bandwidth * 1000}
