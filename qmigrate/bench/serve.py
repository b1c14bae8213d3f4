"""`qmigrate bench serve`: a load generator for any OpenAI-compatible server.

Every call streams (SSE) from /v1/completions, or /v1/chat/completions for multi-turn sessions,
and is timestamped chunk by chunk as it arrives (serve_client.py); serve_stats.py turns that
into the figures. Sessions go as plain-text completions when asked, or when the server
refuses chat messages for want of a chat template; or as token-id completions that carry the
ids the server returned for each answer (serve_data.with_turn_ids). Calls go out from one process, or from
several (serve_procs.py). Calls arrive all at once, or at a Poisson or gamma rate, optionally under a concurrency cap;
a list of rates is a sweep. `ignore_eos` and `min_tokens` (vLLM's extensions, which qmigrate
accepts) make every output exactly as long as asked, and a `cache_salt` of its own for each run
(and the warm-up) keeps a run from being served out of the prefix cache an earlier one filled.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

from qmigrate.bench.serve_client import Client
from qmigrate.bench.serve_send import send_all
from qmigrate.bench.serve_data import ServeRequest
from qmigrate.bench.serve_metrics import ServerCounters, describe
from qmigrate.bench.serve_stats import CallRecord, format_rows, keep_up_warnings, summarize

SESSIONS_AS = ("auto", "chat", "text", "ids")


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of `n` arrivals from 0: all at 0 for an infinite rate, else gaps drawn from a
    gamma of mean 1/rate and shape `burstiness` (1: Poisson; below 1 burstier, above steadier)."""
    if math.isinf(rate):
        return [0.0] * n
    if not rate > 0 or not burstiness > 0:
        raise ValueError("the request rate and the burstiness must be > 0")
    r = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += r.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


class Share(float):
    """A rate given as a share of the saturating rate (`0.8x`): the requests per second that the
    last all-at-once run of the same sweep completed, times this."""


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            rate = math.inf if part in ("inf", "all") else Share(part[:-1]) if part.endswith("x") else float(part)
        except ValueError:
            raise ValueError(f"request rate {part!r}: give numbers (requests/s), inf, or shares of the inf run's "
                             "requests/s such as 0.8x, e.g. 2,4,8,inf or inf,0.5x,0.8x,1x") from None
        if not rate > 0:
            raise ValueError(f"request rate {part!r} must be > 0")
        if isinstance(rate, Share) and not any(math.isinf(r) for r in rates):
            raise ValueError(f"request rate {part!r}: a share of the saturating rate needs an inf run before it")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


def request_offsets(requests: list[ServeRequest], rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times: arrival_offsets per request, or, for requests of bursts (ServeRequest.burst),
    one arrival per burst at rate / (requests a burst), every request of a burst at its time."""
    bursts = sorted({r.burst for r in requests if r.burst >= 0})
    if not bursts:
        return arrival_offsets(len(requests), rate, burstiness, seed)
    per_burst = len(requests) / len(bursts)
    times = dict(zip(bursts, arrival_offsets(len(bursts), rate / per_burst, burstiness, seed)))
    stray = iter(arrival_offsets(len(requests), rate, burstiness, seed + 1))
    return [times[r.burst] if r.burst >= 0 else next(stray) for r in requests]


async def run_load(client: Client, requests: list[ServeRequest], rate: float, *, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0, name: str = "serve"):
    """All of `requests` at the given arrivals, from this process; returns (records, t0, end)."""
    from qmigrate.ops.progress import ProgressLine
    offsets = request_offsets(requests, rate, burstiness, seed)
    bodies = client.bodies(requests)
    progress = ProgressLine(f"  {name}")
    records: list[CallRecord] = []
    t0 = time.perf_counter()

    def show(rec: CallRecord | None = None):
        if progress.due():
            done = sum(rec.output_tokens or len(rec.chunks) for rec in records)
            progress.show(sum(1 for rec in records if rec.ok), sum(r.num_calls for r in requests),
                          done / max(time.perf_counter() - t0, 1e-9))

    await send_all(client, requests, bodies, offsets, t0, max_concurrency, records, show)
    end = max((rec.chunks[-1] for rec in records if rec.chunks), default=time.perf_counter())
    progress.clear()
    return records, t0, end


def write_calls(out, rate: str, records: list[CallRecord], t0: float) -> None:
    """One JSON line per call: what the summary is computed from, to look at a tail call by call."""
    for rec in records:
        out.write(json.dumps({"rate": rate, "start": round(rec.start - t0, 6),
                              "chunks": [round(t - t0, 6) for t in rec.chunks],
                              "output_tokens": rec.output_tokens, "expected_tokens": rec.expected_tokens,
                              "cached_tokens": rec.cached_tokens,
                              "error": rec.error}) + "\n")


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run_serve(*, base_url: str, model: str | None, requests: list[ServeRequest], rates: list[float],
              burstiness: float = 1.0, max_concurrency: int | None = None, slos: dict | None = None,
              seed: int = 0, warmup: int = 2, extensions: bool = True, json_path: Path | None = None,
              dataset: dict | None = None, pipeline_json: Path | None = None,
              sessions_as: str = "auto", calls_path: Path | None = None,
              salt_runs: bool = True, processes: int = 1, metrics_url: str | None = None,
              logprobs: int = -1) -> list[tuple[str, dict]]:
    """sessions_as: chat (chat messages), text (plain-text completions), ids (token-id
    completions; the sessions carry turn_ids), or auto (chat unless the server has no chat
    template for its model). salt_runs: each run and the warm-up send a
    cache_salt of their own, so that no run starts on prefixes an earlier one cached.
    processes: client processes sending the calls (serve_procs.py). metrics_url: a qmigrate
    router's /metrics, read before and after each run (serve_metrics.py). A Share rate runs at
    that share of the requests per second of the last inf run before it. logprobs >= 0: every
    call asks for each token's logprob and that many alternatives' (chat: logprobs and
    top_logprobs)."""
    if processes < 1:
        raise ValueError("the client needs at least one process")
    processes = min(processes, max_concurrency or processes, len(requests))   # each with a share of calls
    if sessions_as not in SESSIONS_AS:
        raise ValueError(f"sessions go as {' or '.join(SESSIONS_AS)}, not {sessions_as!r}")
    if sessions_as == "ids" and any(r.is_session and len(r.turn_ids) != len(r.turns) for r in requests):
        raise ValueError("sessions as token ids need each turn's ids (serve_data.with_turn_ids)")

    calls = open(calls_path, "w") if calls_path is not None else None
    salt_base = f"bench-{random.SystemRandom().getrandbits(48):012x}"
    warm = [ServeRequest(r.prompt, min(r.output_len, 8), r.turns[:1], r.prompt_len, turn_ids=r.turn_ids[:1])
            for r in requests[:warmup]]
    formats = [r.response_format for r in requests if r.response_format is not None]
    if formats and warm:   # the server's first structured call compiles its grammar: not in the timed runs
        warm[-1].response_format = formats[0]
    salts = [f"{salt_base}-run-{i}" if salt_runs else None for i in range(len(rates))]
    warm_salt = f"{salt_base}-warm-up" if salt_runs else None
    runs = []

    server = ServerCounters(metrics_url)
    saturating = [0.0]   # requests/s of the last inf run

    def resolve(rate: float) -> float:
        return rate * saturating[0] if isinstance(rate, Share) else rate

    def ran(rate: float, records: list[CallRecord], t0: float, end: float) -> None:
        summary = summarize(records, t0, end, slos)
        summary["t0_monotonic"] = t0   # time.perf_counter() at the run's start: the system's monotonic clock
        if isinstance(rate, Share):
            summary["share_of_saturation"] = float(rate)
        if (counts := server.stop()) is not None:
            summary["server"] = counts
        if math.isinf(rate):
            saturating[0] = summary["requests_per_s"]
        label = rate_label(resolve(rate))
        runs.append((label, summary))
        if calls is not None:
            write_calls(calls, label, records, t0)

    async def probe() -> tuple[str, str]:
        """The model to name, and how sessions go."""
        async with Client(base_url, model or "", extensions=extensions) as client:
            client.model = served = model or await client.first_model()
            sent_as = sessions_as
            if sessions_as == "auto":
                sent_as = "chat"
                if any(r.is_session for r in requests) and not await client.takes_chat():
                    sent_as = "text"
                    print("bench serve: the server's model has no chat template: sessions go as plain-text "
                          "completions", file=sys.stderr)
            return served, sent_as

    async def in_process(served: str, sent_as: str) -> None:
        async with Client(base_url, served, extensions=extensions, sessions_as=sent_as, logprobs=logprobs) as client:
            if warm:
                client.salt = warm_salt
                await run_load(client, warm, math.inf, name="warm-up")
            for i, rate in enumerate(rates):
                client.salt = salts[i]
                server.start()
                ran(rate, *await run_load(client, requests, resolve(rate), burstiness=burstiness,
                                          max_concurrency=max_concurrency, seed=seed + i,
                                          name=f"rate {rate_label(resolve(rate))}"))

    def from_processes(served: str, sent_as: str) -> None:
        from qmigrate.bench.serve_procs import ClientProcesses
        from qmigrate.ops.progress import ProgressLine
        pool = ClientProcesses(processes, base_url, served, extensions=extensions, sessions_as=sent_as,
                               logprobs=logprobs)
        finished = False
        try:
            if warm:
                pool.run(warm, [0.0] * len(warm), warm_salt, None)
            for i, rate in enumerate(rates):
                progress = ProgressLine(f"  rate {rate_label(resolve(rate))}")
                offsets = request_offsets(requests, resolve(rate), burstiness, seed + i)
                server.start()
                records, t0 = pool.run(requests, offsets, salts[i], max_concurrency, progress)
                progress.clear()
                ran(rate, records, t0, max((rec.chunks[-1] for rec in records if rec.chunks), default=t0))
            finished = True
        finally:
            pool.close(5.0 if finished else 0.0)

    total = sum(r.output_tokens for r in requests)
    print(f"bench serve: {base_url}, {len(requests)} requests ({sum(r.num_calls for r in requests)} calls), "
          f"{total:,} output tokens asked" + (f", from {processes} client processes" if processes > 1 else ""),
          file=sys.stderr)
    try:
        served, sent_as = asyncio.run(probe())
        if processes > 1:
            from_processes(served, sent_as)
        else:
            asyncio.run(in_process(served, sent_as))
    finally:
        if calls is not None:
            calls.close()
    table = format_rows(runs)
    print(table)
    for rate, s in runs:
        if "later_turns" in s:
            later = s["later_turns"]
            hits = later["prefix_hit_rate"]
            earlier = later.get("earlier_hit_rate")
            print(f"  rate {rate}: turns after the first: {later['calls']} calls, TTFT p50/p99 "
                  f"{later['ttft_ms']['p50']:.1f}/{later['ttft_ms']['p99']:.1f} ms, prefix hits "
                  + ("-" if hits is None else f"{100 * hits:.0f}%")
                  + ("" if earlier is None else f" ({100 * earlier:.0f}% of the conversation before them)"))
    for rate, s in runs:
        if "plain" in s:
            plain, structured = s["plain"], s["structured"]
            p50 = lambda part: "-" if part["tpot_ms"]["p50"] is None else f"{part['tpot_ms']['p50']:.2f} ms"
            print(f"  rate {rate}: TPOT p50 plain {p50(plain)} ({plain['calls']} calls), "
                  f"structured {p50(structured)} ({structured['calls']} calls)")
        if "server" in s:
            print(f"  rate {rate}: {describe(s['server'])}")
    for rate, s in runs:
        if s["failed"] or s["short_calls"]:
            print(f"  rate {rate}: {s['failed']} calls failed, {s['short_calls']} ended short of their length"
                  + (f"; e.g. {s['errors'][0]}" if s["errors"] else ""), file=sys.stderr)
    for line in keep_up_warnings(runs, sum(r.num_calls for r in requests) / len(requests)):
        print(f"  warning: {line}", file=sys.stderr)
    pipeline = _pipeline_figure(pipeline_json, total) if pipeline_json else None
    if pipeline:
        for rate, s in runs:
            if rate == "inf":
                print(f"HTTP / pipeline = {s['output_tok_per_s'] / pipeline:.3f} "
                      f"({s['output_tok_per_s']:,.0f} / {pipeline:,.0f} tok/s)")
    if json_path is not None:
        report = {"base_url": base_url, "model": served, "dataset": dataset or {}, "output_tokens_asked": total,
                  "burstiness": burstiness, "max_concurrency": max_concurrency, "ignore_eos": extensions,
                  "cache_salt_per_run": salt_runs, "client_processes": processes, "logprobs": logprobs,
                  "sessions_as": sent_as if any(r.is_session for r in requests) else None,
                  "runs": [{"rate": rate, **s} for rate, s in runs], "table": table}
        if pipeline:
            report["pipeline_tok_per_s"] = pipeline
        json_path.write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return runs


def _pipeline_figure(path: Path, total: int) -> float | None:
    """The median pipeline tok/s of a `qmigrate bench --json` report of the same workload."""
    report = json.loads(Path(path).read_text())
    asked = report.get("workload", {}).get("output_tokens")
    if asked != total:
        print(f"  {path}: its workload asked {asked} output tokens, this one {total}: no ratio", file=sys.stderr)
        return None
    rates = sorted(r["tok_per_s"] for r in report.get("runs", []) if r.get("path") == "pipeline")
    return rates[len(rates) // 2] if rates else None
