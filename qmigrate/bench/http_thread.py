"""What ingest's HTTP thread costs per token, without a fleet: the real `HttpServer`, fed by a
fake ingest loop that answers every request with one token per step for all running requests
(one `deliver` call a step, as the detokenizer batches a Tokens message), while `qmigrate bench
serve` (another process) streams the answers. The figure is the tokens per second the thread
gets out when steps cost nothing: the ceiling the HTTP path puts on a fleet.

Run: `python -m qmigrate.bench.http_thread --streams 256 --tokens 256 [--step-ms 0]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import transport


def fake_ingest(server, step_s: float, stop: threading.Event) -> None:
    """Takes submissions and emits one token per running request per step."""
    wake = transport.socket(zmq.PULL, bind="inproc://ingest-http-wake")
    running: dict[int, list[int]] = {}   # seq_id -> [tokens sent, tokens asked]
    while not stop.is_set():
        while wake.poll(0):
            wake.recv()
        while True:
            try:
                seq_id, prompt = server.submissions.get_nowait()
            except Exception:  # noqa: BLE001 -- queue.Empty
                break
            running[seq_id] = [0, prompt.max_new_tokens]
        while not server.cancels.empty():
            running.pop(server.cancels.get(), None)
        if not running:
            wake.poll(5)
            continue
        rows = []
        for seq_id, state in list(running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            rows.append((seq_id, " tok", int(P.Finish.LENGTH) if done else 0, state[0]))
            if done:
                del running[seq_id]
        server.deliver(rows)
        time.sleep(step_s)
    wake.close(linger=0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="Tokenizer directory (default: the tiny model).")
    ap.add_argument("--profile", action="store_true", help="Print where the HTTP thread's time goes (cProfile).")
    args = ap.parse_args(argv)
    from qmigrate.config import IngestConfig
    from qmigrate.engine.builders import build_tiny_model
    from qmigrate.ingest.http import HttpServer
    from qmigrate.ingest.prompts import Defaults
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = args.model or str(build_tiny_model(Path(tempfile.mkdtemp(prefix="qm-http-")) / "tiny"))
    cfg = IngestConfig(node="local", http_port=port, max_pending=max(256, 2 * args.streams), model_name="m")
    server = HttpServer(cfg, model, Defaults())
    prof = None
    if args.profile:
        import cProfile
        prof, run_thread = cProfile.Profile(), server._run
        server._run = lambda: prof.runcall(run_thread)
    server.start()
    stop = threading.Event()
    feeder = threading.Thread(target=fake_ingest, args=(server, args.step_ms / 1000, stop), daemon=True)
    feeder.start()
    out = Path(tempfile.mkdtemp(prefix="qm-http-")) / "serve.json"
    http = next(t for t in threading.enumerate() if t.name == "http")
    clock = time.pthread_getcpuclockid(http.ident)
    cpu0 = time.clock_gettime(clock), resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run([sys.executable, "-m", "qmigrate", "bench", "serve", "--base-url", server.url,
                          "--requests", str(args.streams), "--prompt-len", "4:4", "--vocab", "10:100",
                          "--output-len", f"{args.tokens}:{args.tokens}", "--json", str(out)], check=False)
    http_cpu = time.clock_gettime(clock) - cpu0[0]  # while the thread lives
    stop.set()
    if prof is not None:
        import pstats
        server.loop.call_soon_threadsafe(server.loop.stop)  # ends runcall, so the profile is whole
        time.sleep(0.5)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    if run.returncode:
        raise SystemExit(run.returncode)
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu = child.ru_utime + child.ru_stime - cpu0[1].ru_utime - cpu0[1].ru_stime
    report = json.loads(out.read_text())["runs"][0]
    per_k = 1000 / report["output_tokens"]
    print(json.dumps({"streams": args.streams, "tokens": args.tokens, "step_ms": args.step_ms,
                      "tok_per_s": round(report["output_tok_per_s"]), "seconds": round(report["duration_s"], 3),
                      "http_thread_cpu_ms_per_1k_tokens": round(http_cpu * per_k * 1000, 1),
                      "client_cpu_ms_per_1k_tokens": round(client_cpu * per_k * 1000, 1),
                      "itl_ms": report["itl_ms"]}))


if __name__ == "__main__":
    main()
