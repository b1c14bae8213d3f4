"""What ingest's HTTP thread costs, without a fleet: the real `HttpServer`, fed by a fake ingest
loop that answers every request with one token per step for all running requests (one
`deliver` call a step, as the detokenizer batches a Tokens message), while the client of
`qmigrate bench serve` (another process) streams the answers.

Two figures. Per token: the tokens per second the thread gets out when steps cost nothing, the
ceiling the HTTP path puts on a fleet. Admission: from the first of the requests sent at once
reaching the server to the last taken by the ingest loop, what the server's thread spent on it,
and the client's TTFT; `--hold` keeps every token back until all requests are in, so the
admission figures count nothing else.

Run: `python -m benchmarks.http_thread --streams 256 --tokens 256 [--step-ms 2]`, or
`--mixed` for mixed-256's shape (prompts of 64-512 ids, outputs of 32-512 tokens); `--logprobs
5` has every call ask for logprobs and every token carry them (`--model` a real tokenizer, so
that the alternatives' texts are a real vocabulary's).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from benchmarks import module_command
from qmigrate.wire import protocol as P
from qmigrate.wire import transport

WARMUP = 2  # the client's warm-up calls, before the timed ones


def fake_ingest(server, step_s: float, stop: threading.Event, taken: list[float], hold: int = 0,
                logprobs: int = -1, vocab: int = 1000) -> None:
    """Takes submissions and emits one token per running request per step; with `hold` (a
    run's requests), none while a run's requests are not all in. `taken` gets the time of each
    take. With `logprobs` >= 0 each token comes with its logprob and that many alternatives',
    as the detokenizer sends them (ingest.handoff.reply_rows), ids drawn from `vocab`."""
    ids = itertools.count()
    wake = transport.socket(zmq.PULL, bind="inproc://ingest-http-wake")
    running: dict[int, list[int]] = {}   # seq_id -> [tokens sent, tokens asked]
    while not stop.is_set():
        while wake.poll(0):
            wake.recv()
        while True:
            try:
                choices = server.submissions.get_nowait()
            except queue.Empty:
                break
            taken.append(time.perf_counter())
            for seq_id, prompt in choices:
                running[seq_id] = [0, prompt.max_new_tokens]
        while not server.cancels.empty():
            running.pop(server.cancels.get(), None)
        if not running or (hold and len(taken) % (WARMUP + hold) > WARMUP):
            wake.poll(5)
            continue
        rows = []
        for seq_id, state in list(running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            row = (seq_id, " tok", int(P.Finish.LENGTH) if done else 0, state[0])
            if logprobs >= 0:
                k = next(ids)
                top = [(k * 7919 + j * 104729) % vocab for j in range(logprobs)]
                values = [-0.25 - 0.5 * j for j in range(logprobs + 1)]
                row = (*row, -1, [((k * 31) % vocab, values, top)], None)
            rows.append(row)
            if done:
                del running[seq_id]
        server.deliver(rows)
        time.sleep(step_s)
    wake.close(linger=0)


def _stamped_server():
    from qmigrate.ingest.http import HttpServer

    class StampedServer(HttpServer):
        """The HTTP server, noting when each completion request reaches it: (time, the HTTP
        thread's CPU time)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.arrived: list[tuple[float, float]] = []

        async def completions(self, request):
            self.arrived.append((time.perf_counter(), time.thread_time()))
            return await super().completions(request)
    return StampedServer


def run_client(url: str, streams: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
               runs: int, out: Path, logprobs: int = -1) -> None:
    """`qmigrate bench serve`'s client, `runs` times: a warm-up, then `streams` calls sent at
    once; the figures of each, with the process's CPU time over it, go in `out`."""
    from qmigrate.bench import serve_data as D
    from qmigrate.bench.core import Workload
    from qmigrate.bench.serve import run_load
    from qmigrate.bench.serve_client import Client
    from qmigrate.bench.serve_stats import summarize
    reqs = D.random_dataset(Workload(streams, prompt_len, output_len, (10, 1000), 0))

    async def main() -> list[dict]:
        report = []
        for _ in range(runs):  # each as `bench serve` runs: new connections, after its warm-up
            async with Client(url, "m", logprobs=logprobs) as client:
                await run_load(client, [D.ServeRequest(r.prompt, 8) for r in reqs[:WARMUP]], math.inf, name="warm-up")
                cpu = time.process_time()
                records, t0, end = await run_load(client, reqs, math.inf)
                report.append({**summarize(records, t0, end), "client_cpu_s": time.process_time() - cpu})
        return report
    out.write_text(json.dumps(asyncio.run(main())))


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="Output tokens of every request.")
    ap.add_argument("--prompt-len", default="4:4", help="Prompt ids, MIN:MAX.")
    ap.add_argument("--output-len", default=None, help="Output tokens, MIN:MAX (default: --tokens).")
    ap.add_argument("--mixed", action="store_true",
                    help="mixed-256's shape: prompts of 64-512 ids, outputs of 32-512 tokens.")
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--hold", action="store_true", help="No token until every request is in.")
    ap.add_argument("--runs", type=int, default=3, help="Loads one after another; the medians are printed.")
    ap.add_argument("--model", default=None, help="Tokenizer directory (default: the tiny model).")
    ap.add_argument("--logprobs", type=int, default=-1,
                    help="Every call asks for logprobs with this many alternatives, and every token has them.")
    ap.add_argument("--profile", action="store_true",
                    help="Print where the HTTP thread's CPU time goes (cProfile on the thread's clock).")
    ap.add_argument("--client", nargs=4, metavar=("URL", "STREAMS", "PROMPT", "OUTPUT"), help=argparse.SUPPRESS)
    ap.add_argument("--client-json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        url, streams, prompt, output = args.client
        return run_client(url, int(streams), _span(prompt), _span(output), args.runs, args.client_json,
                          args.logprobs)
    prompt_len, output_len = ("64:512", "32:512") if args.mixed else \
        (args.prompt_len, args.output_len or f"{args.tokens}:{args.tokens}")
    tmp = Path(tempfile.mkdtemp(prefix="qm-http-"))
    try:
        report = _measure(args, tmp, prompt_len, output_len)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report))


def _measure(args, tmp: Path, prompt_len: str, output_len: str) -> dict:
    from qmigrate.config import IngestConfig
    from qmigrate.hub.builders import build_tiny_model
    from qmigrate.ingest.prompts import Defaults
    from qmigrate.ops.process import freeze_heap
    model = args.model
    if model is None:   # the tiny model, its context widened so that mixed-256's longest requests fit
        model = build_tiny_model(tmp / "tiny")
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = max(config["max_position_embeddings"], 2048)
        (model / "config.json").write_text(json.dumps(config))
    cfg = IngestConfig(node="local", http_port=_free_port(), max_pending=max(256, 2 * args.streams), model_name="m")
    server = _stamped_server()(cfg, str(model), Defaults())
    arrived = server.arrived
    freeze_heap()  # as ingest does before it serves
    server.start()
    prof = None
    if args.profile:   # cProfile profiles the thread that enables it: the HTTP thread, on its own clock
        import cProfile
        prof = cProfile.Profile(time.thread_time)
        server.loop.call_soon_threadsafe(prof.enable)
    stop, taken = threading.Event(), []
    feeder = threading.Thread(target=fake_ingest, daemon=True,
                              args=(server, args.step_ms / 1000, stop, taken, args.streams if args.hold else 0,
                                    args.logprobs, len(server.tokenizer)))
    feeder.start()
    out = tmp / "client.json"
    http = next(t for t in threading.enumerate() if t.name == "http")
    clock = time.pthread_getcpuclockid(http.ident)
    argv, env = module_command("http_thread", "--client", server.url, str(args.streams), prompt_len, output_len,
                               "--runs", str(args.runs), "--client-json", str(out), "--logprobs", str(args.logprobs))
    run = subprocess.run(argv, env=env, check=False)
    http_end = time.clock_gettime(clock)  # while the thread lives
    stop.set()
    feeder.join(2.0)
    if prof is not None:
        import pstats
        disabled = threading.Event()
        server.loop.call_soon_threadsafe(lambda: (prof.disable(), disabled.set()))
        disabled.wait(5.0)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    if run.returncode:
        raise SystemExit(run.returncode)
    return _figures(args, prompt_len, output_len, json.loads(out.read_text()), arrived, taken, http_end)


def _figures(args, prompt_len: str, output_len: str, runs: list[dict], arrived: list, taken: list,
             http_end: float) -> dict:
    """Each figure's median over the runs. A run's HTTP CPU: from its first request's arrival
    to the next run's warm-up (which the client starts at once)."""
    n, rows = args.streams, []
    for i, run in enumerate(runs):
        first = WARMUP + i * (WARMUP + n)
        timed, took = arrived[first:first + n], taken[first:first + n]
        cpu_end = arrived[first + n][1] if i + 1 < len(runs) else http_end
        per_k = 1000 / max(run["output_tokens"], 1)
        rows.append({"tok_per_s": run["output_tok_per_s"], "seconds": run["duration_s"],
                     "admission_ms": 1000 * (max(took) - timed[0][0]),
                     "http_cpu_us_per_admission": 1e6 * (timed[-1][1] - timed[0][1]) / max(n - 1, 1),
                     "ttft_p50_ms": run["ttft_ms"]["p50"] or 0.0, "tpot_p50_ms": run["tpot_ms"]["p50"] or 0.0,
                     "itl_p50_ms": run["itl_ms"]["p50"] or 0.0, "itl_p99_ms": run["itl_ms"]["p99"] or 0.0,
                     "http_thread_cpu_ms_per_1k_tokens": (cpu_end - timed[0][1]) * per_k * 1000,
                     "client_cpu_ms_per_1k_tokens": run["client_cpu_s"] * per_k * 1000,
                     "failed": run["failed"]})
    median = {k: round(statistics.median(r[k] for r in rows), 3 if k == "seconds" else 1) for k in rows[0]}
    median["failed"] = sum(r["failed"] for r in rows)
    return {"streams": n, "prompt_len": prompt_len, "output_len": output_len, "step_ms": args.step_ms,
            "hold": args.hold, "runs": len(rows), **median}


if __name__ == "__main__":
    main()
