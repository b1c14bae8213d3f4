"""Four GPUs: what request migration buys, a drain under load, a 70B-class model over four
GPUs with tensor parallelism, and linear scaling. Parts, any of them comma-separated:

  migration  per model (the benchmark model M, the Llama-3.1-8B shape L8): `qmigrate serve` on
             every GPU with router policy affinity (the default: moves for load and memory),
             pinned (moves off) and any; on each, `qmigrate bench serve` at shares of the
             saturating rate (measured first, on the default server, all at once) of two loads:
             ShareGPT with a tenth of the requests asking 2,048-4,096 tokens (EOS ignored; cut
             to the model's context), and bursts of requests that share a document and arrive
             together. Each worker's KV pool is capped at half a burst's KV (--kv-tokens-*), so
             that a burst overflows the worker holding its document while the fleet has room,
             and long outputs fill a worker. TTFT p50/p99, ITL p99, tok/s, and the server's
             migrations by cause and mechanism, preemptions, KV bytes shipped and tokens per
             worker, per run; the router's queue depth and each pool's least free blocks,
             sampled through each policy's run of a workload.
  drain      M on four workers at 80% of the saturating rate (ShareGPT); `qmigrate drain` of one
             worker mid-run: calls lost or repeated, the pauses of the streams in flight at the
             drain (at the client), tok/s before and after.
  tp70b      Llama-3.1-70B shape, dummy bf16 weights, `--tensor-parallel-size 4`: the decode step
             at batch 1/64/256 (TPOT p50 of that many streams of 512-token prompts, all decoding)
             against the floor of one GPU's shard; ShareGPT; the same ShareGPT on two TP=2
             workers (part tp70b-tp2, separate: it needs a second start of the model).
  scaling    `qmigrate bench --paths pipeline` with N workers and N x 256 requests against one
             with 256, N = 2 and 4; `qmigrate serve` on four GPUs against one: mixed N x 1,024
             tok/s, and the shared-prefix workload's prefix hit rate.

Every step checks the wall-time budget (--budget-s) and is skipped, and said so, when it would
not fit. Results: a JSON and a table on stdout and in --out (default $OUT, else bench-four-gpu).
`--tiny` runs every part on the CPU with the tiny model, two CPU workers and a few requests
(a check of the driver, not a measurement).

    python -m benchmarks.four_gpu migration --out DIR
    python -m benchmarks.four_gpu drain,scaling --out DIR
    python -m benchmarks.four_gpu tp70b --out DIR --tokenizer SMOLLM2_DIR
    python -m benchmarks.four_gpu migration,drain,tp70b,scaling --tiny --out /tmp/t
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.four_gpu_lib import (PY, Budget, RouterSampler, Server, bench_serve, burst_kv_tokens, drain_effects,
                                     finish_bench, read_calls, saturating_rate, shard_floor_ms)
from benchmarks.four_gpu_report import PARTS, ratios, table

POLICIES = ("affinity", "pinned", "any")
# burst workload per model: requests a burst, tokens of the document they share, output lengths.
# Each worker's KV pool is capped (burst_kv_tokens) so that a burst, which cache-aware placement
# sends to the worker holding its document, overflows that worker's pool and fits the fleet's:
# M 107,008 tokens a worker, L8 136,192 (uncapped an H200 holds ~1.6M of M's, and nothing fills).
BURSTS = {"m": (256, 1024, "512:1024"), "l8": (128, 2048, "1024:3072")}
QUESTION_LEN = 64


def q(*args: str, check: bool = True) -> str:
    out = subprocess.run([PY, "-m", "qmigrate", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"qmigrate {' '.join(args)}: {out.stderr[-1500:]}")
    return out.stdout.strip()


class Setup:
    """Models, sizes and serve flags: the GPU machine's, or --tiny's."""

    def __init__(self, a):
        self.a, self.tiny = a, a.tiny
        self.work = Path(a.work)
        self.work.mkdir(parents=True, exist_ok=True)
        tok = ["--tokenizer", a.tokenizer] if a.tokenizer else []
        if self.tiny:
            from qmigrate.hub.builders import build_tiny_model
            tiny = str(build_tiny_model(self.work / "tiny"))
            self.models = {"tiny": tiny}
            self.context = {"tiny": 512}
            self.serve_flags = ["--cpu-workers", "2"]
            self.client = ["--client-processes", "1", "--warmup", "1"]
            return
        m = self.work / "bench-model"
        if not (m / "config.json").exists() and {"migration", "drain", "scaling"} & set(a.parts):
            q("model", "bench", str(m))
        self.models = {"m": str(m)}
        self.context = {"m": 2048, "l8": 131072, "l70": 131072}
        for key, shape in (("l8", "llama-3.1-8b"), ("l70", "llama-3.1-70b")):
            d = self.work / shape
            if key == "l70" and not ({"tp70b", "tp70b-tp2"} & set(a.parts)):
                continue
            if key == "l8" and "l8" not in a.models:
                continue
            if not (d / "config.json").exists():
                q("model", "shape", shape, str(d), *tok)
            self.models[key] = str(d)
        self.serve_flags = []
        self.client = []

    def model_flags(self, key: str, migration: bool = False) -> list[str]:
        """Serve flags for a model; `migration`: the migration part's, whose KV pools are
        capped from the burst's size unless --kv-tokens-* says otherwise (elsewhere only a
        size given there caps them)."""
        if self.tiny:
            return ["--max-num-seqs", "16", "--worker-setting", "max_kv_tokens=2048"]
        flags = [] if key == "m" else ["--load-format", "dummy"]
        kv = {"m": self.a.kv_tokens_m, "l8": self.a.kv_tokens_l8}.get(key, 0)
        if kv < 0 and migration:
            per, doc, out = BURSTS[key]
            kv = burst_kv_tokens(per, doc, QUESTION_LEN, out)
        return flags + (["--worker-setting", f"max_kv_tokens={kv}"] if kv > 0 else [])

    def sharegpt(self, key: str, n: int, long: bool = True) -> list[str]:
        if self.tiny:   # the tiny model's 512 positions: random prompts of ShareGPT-like spread
            base = ["--dataset", "random", "--requests", str(n), "--prompt-len", "8:64", "--output-len", "8:48",
                    "--vocab", "10:1000"]
            return base + (["--long-output-fraction", "0.1", "--long-output-len", "200:300", "--max-model-len",
                            "512"] if long else [])
        base = ["--dataset", "sharegpt", "--tokenizer", self.models[key], "--requests", str(n)]
        return base + (["--long-output-fraction", "0.1", "--long-output-len", "2048:4096", "--max-model-len",
                        str(self.context[key])] if long else [])

    def burst(self, key: str, bursts: int) -> list[str]:
        if self.tiny:
            return ["--dataset", "burst", "--groups", str(bursts), "--prompts-per-group", "6", "--system-len", "64",
                    "--question-len", "8", "--output-len", "40:80", "--vocab", "10:1000"]
        per, doc, out = BURSTS[key]
        return ["--dataset", "burst", "--groups", str(bursts), "--prompts-per-group", str(per), "--system-len",
                str(doc), "--question-len", str(QUESTION_LEN), "--output-len", out, "--vocab", "10:31000"]

    def per_burst(self, key: str) -> int:
        return 6 if self.tiny else BURSTS[key][0]


def _point(run: dict) -> dict:
    """The figures of one bench serve run that the summary shows."""
    server = run.get("server") or {}
    return {"rate": run["rate"], "share": run.get("share_of_saturation"), "tok_per_s": run["output_tok_per_s"],
            "req_per_s": run["requests_per_s"], "ttft_p50_ms": run["ttft_ms"]["p50"],
            "ttft_p99_ms": run["ttft_ms"]["p99"], "itl_p99_ms": run["itl_ms"]["p99"],
            "tpot_p50_ms": run["tpot_ms"]["p50"], "ttft_p50_ms_by_quarter": run.get("ttft_p50_ms_by_quarter"),
            "failed": run["failed"], "short": run["short_calls"],
            "migrations": server.get("migrations_by_cause"), "mechanisms": server.get("migrations_by_mechanism"),
            "preemptions": server.get("preemptions"), "kv_bytes_shipped": server.get("kv_bytes_shipped"),
            "resends": server.get("resends"), "tokens_by_worker": server.get("tokens_by_worker"),
            "prefix_hit_rate": server.get("prefix_hit_rate", run.get("prefix_hit_rate"))}


def migration(s: Setup, budget: Budget, out: Path, results: dict) -> dict:
    """Fills `results` as it goes (a stop midway leaves the points measured)."""
    a = s.a
    keys = ["tiny"] if s.tiny else [k for k in a.models if k in s.models]
    loads = [float(x) for x in a.loads.split(",")]
    point_s = 3.0 if s.tiny else a.point_s
    for key in keys:
        model, res = s.models[key], {"workloads": {}}
        results[key] = res
        rates: dict[str, float] = dict(a.saturation_rps)   # given: that workload's all-at-once run is not made
        for policy in a.policies.split(","):
            if not budget.allows(f"migration {key} policy {policy}", 60 + 2 * (point_s + 30) * len(loads)):
                continue
            flags = [*s.serve_flags, *s.model_flags(key, migration=True), "--migration-policy", policy]
            with Server(model, out / f"serve-{key}-{policy}.log", flags) as srv:
                for wl in a.workloads.split(","):
                    tag = f"{key}-{wl}-{policy}"
                    if wl not in rates:   # the saturating rate: everything at once, on this first server
                        n_sat = 24 if s.tiny else a.saturation_requests
                        args = s.sharegpt(key, n_sat) if wl == "sharegpt" else s.burst(
                            key, max(2, n_sat // s.per_burst(key)))
                        bench_serve(srv.url, [*args, *s.client, "--request-rate", "inf"], out, f"{tag}-inf",
                                    metrics_url=srv.metrics_url)
                        sat = saturating_rate(read_calls(out / f"{tag}-inf.calls.jsonl")["inf"])
                        rates[wl] = sat["requests_per_s"]
                        res["workloads"].setdefault(wl, {})["saturation"] = sat
                    todo = [(load, load * rates[wl]) for load in loads]
                    n = max(8, min(a.max_requests, int(max(r for _, r in todo) * point_s)))
                    args = s.sharegpt(key, n) if wl == "sharegpt" else s.burst(key, max(2, n // s.per_burst(key)))
                    rate_list = ",".join(f"{r:.3f}" for _, r in todo)
                    with RouterSampler(srv.metrics_url) as sampled:   # queueing and pools, all loads together
                        report = bench_serve(srv.url, [*args, *s.client, "--request-rate", rate_list], out, tag,
                                             metrics_url=srv.metrics_url)
                    res["workloads"].setdefault(wl, {}).setdefault("router", {})[policy] = sampled.summary()
                    points = res["workloads"][wl].setdefault("points", {})
                    for (load, _), run in zip(todo, report["runs"]):
                        points.setdefault(f"{load:g}", {})[policy] = _point(run)
        ratios(res)
    return results


def drain(s: Setup, budget: Budget, out: Path) -> dict:
    a = s.a
    key = "tiny" if s.tiny else "m"
    point_s = 5.0 if s.tiny else a.drain_point_s
    if not budget.allows("drain", 60 + 2 * point_s + 60):
        return {}
    with Server(s.models[key], out / "serve-drain.log", [*s.serve_flags, *s.model_flags(key)]) as srv:
        n_sat = 24 if s.tiny else a.saturation_requests
        bench_serve(srv.url, [*s.sharegpt(key, n_sat, long=False), *s.client, "--request-rate", "inf"], out,
                    "drain-inf", metrics_url=srv.metrics_url)
        sat = saturating_rate(read_calls(out / "drain-inf.calls.jsonl")["inf"])
        rate = a.drain_load * sat["requests_per_s"]
        n = max(8, min(a.drain_requests, int(rate * point_s)))
        drain_at = n / rate / 3   # a third into the arrivals
        finished0 = srv.counter("qmigrate_requests_finished_total")
        proc = bench_serve(srv.url, [*s.sharegpt(key, n, long=False), *s.client, "--request-rate", f"{rate:.3f}"],
                           out, "drain", metrics_url=srv.metrics_url, background=True)
        # drain once the timed run is under way: that many of its requests have finished
        want = finished0 + 2 + max(1, int(0.5 * rate * drain_at))
        deadline = time.monotonic() + 120
        try:
            while srv.counter("qmigrate_requests_finished_total") < want and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            from qmigrate.config import load_topology
            workers = [w.name for w in load_topology(srv.topology).workers]
            victim = workers[1]
            drained_at = time.perf_counter()
            said = srv.drain(victim)
            report = finish_bench(proc, out / "drain.json")
        finally:
            if proc.poll() is None:   # stopped midway: the client goes with the server
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    run = report["runs"][0]
    calls = next(iter(read_calls(out / "drain.calls.jsonl").values()))
    at = drained_at - run["t0_monotonic"]
    effects = drain_effects(calls, at, before_s=min(15.0, at / 2), arrivals_end=n / rate)
    effects.update(worker=victim, of_workers=len(workers), router_said=said, rate=rate, saturation=sat,
                   three_quarters_of_saturation_tok_per_s=0.75 * sat["tok_per_s"],
                   after_over_three_quarters=effects["tok_per_s_after"] / (0.75 * sat["tok_per_s"]),
                   run=_point(run))
    return effects


def _decode_steps(s: Setup, srv: Server, out: Path, key: str, tp: int, batches: list[int]) -> list[dict]:
    config = json.loads((Path(s.models[key]) / "config.json").read_text())
    prompt, new = (32, 16) if s.tiny else (512, 128)
    rows = []
    for b in batches:
        args = ["--dataset", "random", "--requests", str(b), "--max-concurrency", str(b), "--prompt-len",
                f"{prompt}:{prompt}", "--output-len", f"{new}:{new}", "--vocab", "10:1000" if s.tiny else "10:31000",
                *s.client, "--request-rate", "inf"]
        run = bench_serve(srv.url, args, out, f"{key}-tp{tp}-decode-b{b}", metrics_url=srv.metrics_url)["runs"][0]
        floor = shard_floor_ms(config, tp, b, prompt + new // 2, s.a.bandwidth)
        step = run["tpot_ms"]["p50"]   # tokens that arrive together make ITL p50 0; TPOT spreads them
        rows.append({"batch": b, "step_ms": step, "itl_p50_ms": run["itl_ms"]["p50"], **floor,
                     "x_floor": step / floor["floor_ms"] if step else None})
    return rows


def tp70b(s: Setup, budget: Budget, out: Path, tp: int) -> dict:
    key = "tiny" if s.tiny else "l70"
    n = 16 if s.tiny else s.a.tp_sharegpt_requests
    if not budget.allows(f"tp70b tp={tp}", 240):
        return {}
    flags = [*s.serve_flags, *s.model_flags(key), "--tensor-parallel-size", str(tp)]
    if s.tiny:   # one CPU worker of two ranks: the path, not a figure
        flags = ["--cpu-workers", "1", *s.model_flags(key), "--tensor-parallel-size", "2"]
    elif tp == 2:   # 70.5 GB of weights a GPU: what is left for KV is small
        flags += ["--gpu-memory-utilization", "0.95", "--max-num-seqs", "256"]
    res: dict = {"tp": tp}
    try:
        with Server(s.models[key], out / f"serve-{key}-tp{tp}.log", flags, ready_timeout_s=480) as srv:
            res["started_s"] = srv.started_s
            if tp == 4:
                res["decode"] = _decode_steps(s, srv, out, key, tp, [1, 4] if s.tiny else [1, 64, 256])
            run = bench_serve(srv.url, [*s.sharegpt(key, n, long=False), *s.client, "--request-rate", "inf"], out,
                              f"{key}-tp{tp}-sharegpt", metrics_url=srv.metrics_url)["runs"][0]
            res["sharegpt"] = _point(run)
    except RuntimeError as exc:
        res["error"] = str(exc)[-600:]
    return res


def scaling(s: Setup, budget: Budget, out: Path) -> dict:
    a, res = s.a, {"pipeline": {}, "serve": {}}
    per = 8 if s.tiny else 256
    ns = [1, 2] if s.tiny else [1, 2, 4]
    for n in ns:
        if not budget.allows(f"scaling pipeline N={n}", 45 * a.repeat):
            continue
        dev = ["--device", "cpu", "--prompt-len", "8:16", "--output-len", "8:16"] if s.tiny else \
            ["--device", "cuda", "--model", s.models["m"]]
        path = out / f"pipeline-w{n}.json"
        cmd = [PY, "-m", "qmigrate", "bench", *dev, "--paths", "pipeline", "--workers", str(n), "--requests",
               str(per * n), "--repeat", str(a.repeat), "--json", str(path)]
        print(f"four_gpu: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        rates = sorted(r["tok_per_s"] for r in json.loads(path.read_text())["runs"] if r["path"] == "pipeline")
        res["pipeline"][n] = {"tok_per_s_runs": rates, "tok_per_s": rates[len(rates) // 2]}
    one = res["pipeline"].get(1)
    for n, r in res["pipeline"].items():
        if one and n != 1:
            r["over_n_times_one"] = r["tok_per_s"] / (n * one["tok_per_s"])
    key = "tiny" if s.tiny else "m"
    # serve: 1,024 requests a worker, so that a run lasts seconds, not its first prefills (256 a
    # worker ran 1.4 s on one H200, and measured the start of a burst)
    serve_per = per if s.tiny else 1024
    fleets = [("all", None, 2 if s.tiny else 4), ("one", "0", 1)]
    for name, gpus, workers in fleets:
        if not budget.allows(f"scaling serve {name}", 120):
            continue
        flags = [*s.model_flags(key)] + (["--cpu-workers", str(workers)] if s.tiny else [])
        with Server(s.models[key], out / f"serve-scaling-{name}.log", flags, gpus=gpus) as srv:
            mixed = ["--dataset", "random", "--requests", str(serve_per * workers)] + (
                ["--prompt-len", "8:16", "--output-len", "8:16", "--vocab", "10:1000"] if s.tiny else [])
            r_mixed = bench_serve(srv.url, [*mixed, *s.client, "--request-rate", "inf"], out, f"serve-{name}-mixed",
                                  metrics_url=srv.metrics_url)["runs"][0]
            shared = ["--dataset", "shared-prefix"] + (
                ["--groups", "4", "--prompts-per-group", "4", "--system-len", "64", "--question-len", "8",
                 "--answer-len", "8", "--vocab", "10:1000"] if s.tiny else [])
            r_shared = bench_serve(srv.url, [*shared, *s.client, "--request-rate", "inf"], out,
                                   f"serve-{name}-shared-prefix", metrics_url=srv.metrics_url)["runs"][0]
            res["serve"][name] = {"workers": workers, "mixed_requests": serve_per * workers,
                                  "mixed_tok_per_s": r_mixed["output_tok_per_s"],
                                  "shared_prefix_hit_rate_usage": r_shared.get("prefix_hit_rate"),
                                  "shared_prefix_hit_rate_router": (r_shared.get("server") or {}).get("prefix_hit_rate"),
                                  "shared_prefix_tok_per_s": r_shared["output_tok_per_s"]}
    srv_all, srv_one = res["serve"].get("all"), res["serve"].get("one")
    if srv_all and srv_one:
        res["serve"]["mixed_all_over_n_times_one"] = srv_all["mixed_tok_per_s"] / (
            srv_all["workers"] * srv_one["mixed_tok_per_s"])
        a_hit = srv_all["shared_prefix_hit_rate_usage"] or srv_all["shared_prefix_hit_rate_router"]
        o_hit = srv_one["shared_prefix_hit_rate_usage"] or srv_one["shared_prefix_hit_rate_router"]
        if a_hit is not None and o_hit:
            res["serve"]["hit_rate_all_over_one"] = a_hit / o_hit
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("parts", help=f"comma-separated: {', '.join(PARTS)}")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-four-gpu")
    p.add_argument("--work", default=".bench", help="where models and shapes are built (reused)")
    p.add_argument("--tiny", action="store_true", help="the CPU, the tiny model, a few requests")
    p.add_argument("--tokenizer", default=os.environ.get("TOKENIZER"),
                   help="tokenizer directory for the shapes (default $TOKENIZER; else SmolLM2's, fetched)")
    p.add_argument("--models", default="m", help="migration: m and/or l8")
    p.add_argument("--workloads", default="sharegpt,burst", help="migration: sharegpt and/or burst")
    p.add_argument("--policies", default=",".join(POLICIES), help="migration: router policies, run in this order")
    p.add_argument("--loads", default="0.8", help="migration: shares of the saturating rate, e.g. 0.5,0.8,1")
    p.add_argument("--point-s", type=float, default=30.0, help="migration: seconds of arrivals a point")
    p.add_argument("--max-requests", type=int, default=6000, help="requests a point at most")
    p.add_argument("--saturation-rps", default="", help="migration: WORKLOAD=REQ_PER_S,... saturating rates "
                   "measured before (e.g. sharegpt=20.5), for which no all-at-once run is made")
    p.add_argument("--saturation-requests", type=int, default=3000, help="requests of the all-at-once runs")
    p.add_argument("--kv-tokens-m", type=int, default=-1,
                   help="migration: KV pool of each M worker in tokens (-1, the default: half a burst's KV, "
                        "so that a burst overflows one worker and fits four; 0: from memory)")
    p.add_argument("--kv-tokens-l8", type=int, default=-1, help="migration: the same for L8")
    p.add_argument("--drain-load", type=float, default=0.8)
    p.add_argument("--drain-point-s", type=float, default=60.0, help="drain: seconds of arrivals at most")
    p.add_argument("--drain-requests", type=int, default=12000, help="drain: requests at most")
    p.add_argument("--tp-sharegpt-requests", type=int, default=500)
    p.add_argument("--bandwidth", type=float, default=2.86e12, help="bytes/s of one GPU for the floor")
    p.add_argument("--repeat", type=int, default=2, help="scaling: pipeline runs per N")
    p.add_argument("--budget-s", type=float, default=560.0, help="wall time this invocation may take")
    a = p.parse_args(argv)
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    a.models = [x.strip() for x in a.models.split(",") if x.strip()]
    try:
        a.saturation_rps = {k.strip(): float(v) for k, v in (x.split("=") for x in a.saturation_rps.split(",") if x)}
    except ValueError:
        p.error(f"--saturation-rps takes WORKLOAD=REQ_PER_S,...: {a.saturation_rps!r}")
    if bad := [x for x in a.policies.split(",") if x not in POLICIES]:
        p.error(f"unknown policy(ies) {', '.join(bad)}; policies: {', '.join(POLICIES)}")
    if bad := [x for x in a.parts if x not in PARTS]:
        p.error(f"unknown part(s) {', '.join(bad)}; parts: {', '.join(PARTS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget_s)
    t0 = time.monotonic()
    s = Setup(a)
    results: dict = {"parts": a.parts, "tiny": a.tiny, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    signal.signal(signal.SIGTERM, _stop)
    try:
        _run_parts(a, s, budget, out, results)
    finally:   # a timeout's SIGTERM still leaves what was measured
        results["skipped"], results["wall_s"] = budget.skipped, time.monotonic() - t0
        text = _save(a, out, results)
    print(json.dumps(results, default=str))
    print(text)
    return 1 if any(isinstance(results.get(p), dict) and "error" in results[p] and p != "tp70b-tp2"
                    for p in a.parts) else 0


def _stop(signum, frame):
    raise SystemExit(f"four_gpu: stopped by signal {signum}")


def _save(a, out: Path, results: dict) -> str:
    for res in (results.get("migration") or {}).values():
        if isinstance(res, dict) and "workloads" in res:
            ratios(res)
    text = table(results)
    name = "four-gpu-" + "-".join(a.parts) + ("-tiny" if a.tiny else "")
    (out / f"{name}.json").write_text(json.dumps(results, indent=2, default=str))
    (out / f"{name}.txt").write_text(text + "\n")
    return text


def _run_parts(a, s: Setup, budget: Budget, out: Path, results: dict) -> None:
    for part in a.parts:
        try:
            if part == "migration":
                migration(s, budget, out, results.setdefault(part, {}))
            elif part == "drain":
                results[part] = drain(s, budget, out)
            elif part in ("tp70b", "tp70b-tp2"):
                results[part] = tp70b(s, budget, out, 4 if part == "tp70b" else 2)
            elif part == "scaling":
                results[part] = scaling(s, budget, out)
        except Exception as exc:  # noqa: BLE001 -- one part's failure is reported, the others still run
            results[part] = {**(results.get(part) or {}), "error": f"{type(exc).__name__}: {exc}"[-1500:]}
            print(f"four_gpu: part {part} failed: {exc}", file=sys.stderr, flush=True)
        _save(a, out, results)


if __name__ == "__main__":
    sys.exit(main())
