"""`qmigrate bench serve`: a load generator for any OpenAI-compatible server.

Every call streams (SSE) from /v1/completions, or /v1/chat/completions for multi-turn sessions,
and is timestamped chunk by chunk as it arrives; serve_stats.py turns that into the figures.
Sessions go as plain-text completions (`serve_data.transcript`) when asked, or when the server
refuses chat messages for want of a chat template.
Calls arrive all at once, or at a Poisson or gamma rate, optionally under a concurrency cap;
a list of rates is a sweep. `ignore_eos` and `min_tokens` (vLLM's extensions, which qmigrate
accepts) make every output exactly as long as asked, and a `cache_salt` of its own for each run
(and the warm-up) keeps a run from being served out of the prefix cache an earlier one filled.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import aiohttp

from qmigrate.bench.serve_data import ServeRequest, transcript
from qmigrate.bench.serve_stats import CallRecord, format_rows, summarize

READ_TIMEOUT_S = 600.0
JSON_HEADERS = {"Content-Type": "application/json"}
SESSIONS_AS = ("auto", "chat", "text")


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


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            rate = math.inf if part in ("inf", "all") else float(part)
        except ValueError:
            raise ValueError(f"request rate {part!r}: give numbers (requests/s) or inf, e.g. 2,4,8,inf") from None
        if not rate > 0:
            raise ValueError(f"request rate {part!r} must be > 0")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


# What a JSON string's bytes may hold for them to be its text as they stand.
_NEEDS_DECODING = re.compile(rb'["\\\x00-\x1f]')


def _json_string(literal: bytes) -> str | None:
    """The str a JSON string literal stands for, or None where `literal` is not one."""
    if len(literal) < 2 or literal[:1] != b'"' or literal[-1:] != b'"':
        return None
    body = literal[1:-1]
    if _NEEDS_DECODING.search(body) is None:
        try:
            return body.decode()
        except UnicodeDecodeError:
            return None
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class EventTexts:
    """Reads a stream's middle events without json.loads. A server sends them as the same
    bytes but for the JSON string of their text; once two parsed events have shown the bytes
    around it, an event with those bytes is its text's string, sliced out. Any other event
    (the first, the finish, usage, an error, another server's other shape) is parsed in full."""

    __slots__ = ("head", "tail", "guess")

    def __init__(self) -> None:
        self.head = self.tail = None   # the bytes around the text, once confirmed
        self.guess = None              # (head, tail) seen once, to be confirmed

    def text_of(self, raw: bytes) -> str | None:
        """The text of `raw` where it has the learned shape, else None (parse it)."""
        head, tail = self.head, self.tail
        if head is None or not raw.startswith(head) or not raw.endswith(tail) \
                or len(raw) < len(head) + len(tail):
            return None
        return _json_string(raw[len(head):len(raw) - len(tail)])

    def learn(self, raw: bytes, text: str) -> None:
        """`raw` parsed in full to a middle event (one choice, this text, no finish, usage
        or error): where its text's string sits, if it sits there just once."""
        if self.guess is not None:
            head, tail = self.guess
            if raw.startswith(head) and raw.endswith(tail) and len(raw) >= len(head) + len(tail) \
                    and _json_string(raw[len(head):len(raw) - len(tail)]) == text:
                self.head, self.tail = head, tail
                return
        self.guess = None
        for literal in {json.dumps(text, ensure_ascii=False).encode(), json.dumps(text).encode()}:
            at = raw.find(literal)
            if at >= 0 and raw.find(literal, at + 1) < 0:
                self.guess = raw[:at], raw[at + len(literal):]
                return


class Client:
    def __init__(self, base_url: str, model: str, *, extensions: bool = True, temperature: float = 0.0,
                 sessions_as: str = "chat"):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.extensions, self.temperature = extensions, temperature
        self.sessions_as = sessions_as   # chat, or text: plain-text completions
        self.salt: str | None = None     # the cache_salt every call sends, if any
        self.session = None

    async def __aenter__(self):
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=READ_TIMEOUT_S)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    def _payload(self, output_len: int) -> dict:
        body = {"model": self.model, "max_tokens": output_len, "stream": True, "temperature": self.temperature,
                "stream_options": {"include_usage": True}}
        if self.extensions:
            body.update(ignore_eos=True, min_tokens=output_len)
        if self.salt is not None:
            body["cache_salt"] = self.salt
        return body

    async def complete(self, prompt, output_len: int, rec: CallRecord) -> str:
        return await self.post_completion(self.completion_body(prompt, output_len), rec)

    def completion_body(self, prompt, output_len: int) -> bytes:
        return json.dumps(self._payload(output_len) | {"prompt": prompt}).encode()

    def bodies(self, requests: list[ServeRequest]) -> list[bytes | None]:
        """Every completion's body, encoded before the clock starts (a session's depends on
        its answers: None); encoding 1,024 prompts of 1,152 ids took 150 ms of the client."""
        return [None if r.is_session else self.completion_body(r.prompt, r.output_len) for r in requests]

    async def post_completion(self, body: bytes, rec: CallRecord) -> str:
        return await self._stream("/v1/completions", body, rec, chat=False)

    async def chat(self, messages: list[dict], output_len: int, rec: CallRecord) -> str:
        body = self._payload(output_len) | {"messages": messages}
        return await self._stream("/v1/chat/completions", body, rec, chat=True)

    async def _stream(self, path: str, body: dict | bytes, rec: CallRecord, chat: bool) -> str:
        """Sends one call and reads its events; the text is returned, timings go to `rec`."""
        parts, chunks = [], 0
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        rec.start = time.perf_counter()
        try:
            async with self.session.post(self.base_url + path, data=body, headers=JSON_HEADERS) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return ""
                buf, done, texts = b"", False, EventTexts()
                # Whole reads, split into events here: one await per read, not one per line;
                # events that arrived in one read share its timestamp.
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    *events, buf = (buf + data).split(b"\n\n")
                    for raw in events:
                        if (text := texts.text_of(raw)) is not None:
                            if text:
                                rec.chunks.append(now)
                                parts.append(text)
                                chunks += 1
                            continue
                        if not raw.startswith(b"data: "):
                            continue
                        if raw[6:].strip() == b"[DONE]":
                            done = True
                            break
                        event = json.loads(raw[6:])
                        if "error" in event:
                            rec.error = str(event["error"].get("message", event["error"]))[:200]
                            done = True
                            break
                        choices = event.get("choices") or ()
                        for choice in choices:
                            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                            if text:
                                rec.chunks.append(now)
                                parts.append(text)
                                chunks += 1
                        usage = event.get("usage")
                        if text and len(choices) == 1 and not usage and choices[0].get("finish_reason") is None:
                            texts.learn(raw, text)
                        if usage:
                            rec.output_tokens = usage.get("completion_tokens", 0)
                            rec.prompt_tokens = usage.get("prompt_tokens", 0)
                            details = usage.get("prompt_tokens_details") or {}
                            if isinstance(details.get("cached_tokens"), int):
                                rec.cached_tokens = details["cached_tokens"]
                    if done:
                        break
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
        if not rec.output_tokens:
            rec.output_tokens = chunks
        if not rec.error and not rec.chunks:
            rec.error = "no text"
        return "".join(parts)

    async def session_call(self, turns: list[str], answers: list[str], output_len: int, rec: CallRecord) -> str:
        """The call for the last of `turns`, after the earlier ones were answered so."""
        if self.sessions_as == "text":
            return await self.complete(transcript(turns, answers), output_len, rec)
        messages = []
        for turn, answer in zip(turns, [*answers, None]):
            messages.append({"role": "user", "content": turn})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return await self.chat(messages, output_len, rec)

    async def takes_chat(self) -> bool:
        """False when the server refuses chat messages for want of a chat template (an HTTP 400
        that says so, as qmigrate and vLLM answer)."""
        body = self._payload(1) | {"messages": [{"role": "user", "content": "hello"}]}
        async with self.session.post(self.base_url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 400:
                return True
            return "template" not in (await resp.text()).lower()

    async def first_model(self) -> str:
        async with self.session.get(self.base_url + "/v1/models") as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {self.base_url}/v1/models answered HTTP {resp.status}")
            data = (await resp.json()).get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        return data[0]["id"]


async def run_load(client: Client, requests: list[ServeRequest], rate: float, *, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0, name: str = "serve"):
    """All of `requests` at the given arrivals, from this process; returns (records, t0, end)."""
    from qmigrate.ops.progress import ProgressLine
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
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


async def send_all(client: Client, requests: list[ServeRequest], bodies: list[bytes | None], offsets: list[float],
                   t0: float, max_concurrency: int | None, records: list[CallRecord], on_call) -> None:
    """Sends requests[i] at t0 + offsets[i] (its body already encoded, unless it is a session),
    appending a record per call and calling on_call() after each."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: ServeRequest, body: bytes | None, offset: float):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()
        try:
            if not req.is_session:
                rec = CallRecord(0.0, expected_tokens=req.output_len, prompt_tokens=req.prompt_len)
                records.append(rec)
                await client.post_completion(body, rec)
                on_call(rec)
                return
            answers = []
            for i in range(len(req.turns)):  # each turn carries the earlier turns and their answers
                rec = CallRecord(0.0, expected_tokens=req.output_len)
                records.append(rec)
                answers.append(await client.session_call(req.turns[:i + 1], answers, req.output_len, rec))
                on_call(rec)
                if not rec.ok:
                    return
        finally:
            if gate is not None:
                gate.release()

    await asyncio.gather(*(one(req, body, off) for req, body, off in zip(requests, bodies, offsets)))


def write_calls(out, rate: str, records: list[CallRecord], t0: float) -> None:
    """One JSON line per call: what the summary is computed from, to look at a tail call by call."""
    for rec in records:
        out.write(json.dumps({"rate": rate, "start": round(rec.start - t0, 6),
                              "chunks": [round(t - t0, 6) for t in rec.chunks],
                              "output_tokens": rec.output_tokens, "cached_tokens": rec.cached_tokens,
                              "error": rec.error}) + "\n")


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run_serve(*, base_url: str, model: str | None, requests: list[ServeRequest], rates: list[float],
              burstiness: float = 1.0, max_concurrency: int | None = None, slos: dict | None = None,
              seed: int = 0, warmup: int = 2, extensions: bool = True, json_path: Path | None = None,
              dataset: dict | None = None, pipeline_json: Path | None = None,
              sessions_as: str = "auto", calls_path: Path | None = None,
              salt_runs: bool = True, processes: int = 1) -> list[tuple[str, dict]]:
    """sessions_as: chat (chat messages), text (plain-text completions), or auto (chat unless
    the server has no chat template for its model). salt_runs: each run and the warm-up send a
    cache_salt of their own, so that no run starts on prefixes an earlier one cached.
    processes: client processes sending the calls (serve_procs.py)."""
    if processes < 1:
        raise ValueError("the client needs at least one process")
    if sessions_as not in SESSIONS_AS:
        raise ValueError(f"sessions go as {' or '.join(SESSIONS_AS)}, not {sessions_as!r}")

    calls = open(calls_path, "w") if calls_path is not None else None
    salt_base = f"bench-{random.SystemRandom().getrandbits(48):012x}"
    warm = [ServeRequest(r.prompt, min(r.output_len, 8), r.turns[:1], r.prompt_len) for r in requests[:warmup]]
    salts = [f"{salt_base}-run-{i}" if salt_runs else None for i in range(len(rates))]
    warm_salt = f"{salt_base}-warm-up" if salt_runs else None
    runs = []

    def ran(rate: float, records: list[CallRecord], t0: float, end: float) -> None:
        runs.append((rate_label(rate), summarize(records, t0, end, slos)))
        if calls is not None:
            write_calls(calls, rate_label(rate), records, t0)

    async def probe() -> tuple[str, str]:
        """The model to name, and how sessions go."""
        async with Client(base_url, model or "", extensions=extensions) as client:
            served = model or await client.first_model()
            sent_as = sessions_as
            if sessions_as == "auto":
                sent_as = "chat"
                if any(r.is_session for r in requests) and not await client.takes_chat():
                    sent_as = "text"
                    print("bench serve: the server's model has no chat template: sessions go as plain-text "
                          "completions", file=sys.stderr)
            return served, sent_as

    async def in_process(served: str, sent_as: str) -> None:
        async with Client(base_url, served, extensions=extensions, sessions_as=sent_as) as client:
            if warm:
                client.salt = warm_salt
                await run_load(client, warm, math.inf, name="warm-up")
            for i, rate in enumerate(rates):
                client.salt = salts[i]
                ran(rate, *await run_load(client, requests, rate, burstiness=burstiness,
                                          max_concurrency=max_concurrency, seed=seed + i,
                                          name=f"rate {rate_label(rate)}"))

    def from_processes(served: str, sent_as: str) -> None:
        from qmigrate.bench.serve_procs import ClientProcesses
        from qmigrate.ops.progress import ProgressLine
        pool = ClientProcesses(processes, base_url, served, extensions=extensions, sessions_as=sent_as)
        try:
            if warm:
                pool.run(warm, [0.0] * len(warm), warm_salt, None)
            for i, rate in enumerate(rates):
                progress = ProgressLine(f"  rate {rate_label(rate)}")
                offsets = arrival_offsets(len(requests), rate, burstiness, seed + i)
                records, t0 = pool.run(requests, offsets, salts[i], max_concurrency, progress)
                progress.clear()
                ran(rate, records, t0, max((rec.chunks[-1] for rec in records if rec.chunks), default=t0))
        finally:
            pool.close()

    total = sum(r.output_len * r.num_calls for r in requests)
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
        if s["failed"] or s["short_calls"]:
            print(f"  rate {rate}: {s['failed']} calls failed, {s['short_calls']} ended short of their length"
                  + (f"; e.g. {s['errors'][0]}" if s["errors"] else ""), file=sys.stderr)
    pipeline = _pipeline_figure(pipeline_json, total) if pipeline_json else None
    if pipeline:
        for rate, s in runs:
            if rate == "inf":
                print(f"HTTP / pipeline = {s['output_tok_per_s'] / pipeline:.3f} "
                      f"({s['output_tok_per_s']:,.0f} / {pipeline:,.0f} tok/s)")
    if json_path is not None:
        report = {"base_url": base_url, "model": served, "dataset": dataset or {}, "output_tokens_asked": total,
                  "burstiness": burstiness, "max_concurrency": max_concurrency, "ignore_eos": extensions,
                  "cache_salt_per_run": salt_runs, "client_processes": processes,
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
