"""The figures of `qmigrate bench serve`, from what the client saw of each call (pure).

TTFT: from sending a call to its first event of tokens. TPOT: the time after the first token,
shared by the tokens after it. ITL: the gaps between successive events of tokens, over every
call; an event counts whether its text is empty or not (a token may end mid-character), as
vLLM's benchmark counts them. E2E: from sending to the last event. Goodput: calls per second
that met every SLO given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class CallRecord:
    start: float                         # when the call was sent
    chunks: list[float] = field(default_factory=list)   # arrival time of each event of tokens
    output_tokens: int = 0               # as the server's usage says, else the chunks counted
    expected_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = -1              # usage.prompt_tokens_details.cached_tokens (-1: not said)
    error: str = ""
    turn: int = 0                        # a session's call: which of its turns (0: the first)
    earlier_tokens: int = 0              # ids sessions: the turn before's prompt and answer, which this prompt begins with
    structured: bool = False             # sent with a response_format

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunks[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.chunks[-1] - self.chunks[0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def parse_slos(specs: list[str]) -> dict[str, float]:
    """"ttft:200" "tpot:50" → {"ttft": 0.2, "tpot": 0.05} (milliseconds in, seconds out)."""
    out = {}
    for spec in specs:
        for part in spec.replace(",", " ").split():
            name, _, value = part.partition(":")
            if name not in SLO_NAMES:
                raise ValueError(f"goodput SLO {part!r}: the name must be one of {', '.join(SLO_NAMES)}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"goodput SLO {part!r}: give NAME:MILLISECONDS, e.g. ttft:500") from None
            if not ms > 0:
                raise ValueError(f"goodput SLO {part!r}: the limit must be > 0 ms")
            out[name] = ms / 1000
    return out


def _dist(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in PERCENTILES}}


def meets(rec: CallRecord, slos: dict[str, float]) -> bool:
    if not rec.ok:
        return False
    got = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2e": rec.e2e}
    return all(got[name] <= limit for name, limit in slos.items())


def summarize(records: list[CallRecord], t0: float, end: float, slos: dict[str, float] | None = None) -> dict:
    """Figures of one run; times in ms except `duration_s`."""
    done = [r for r in records if r.ok]
    duration = max(end - t0, 1e-9)
    out_tokens = sum(r.output_tokens for r in done)
    out = {
        "duration_s": duration, "calls": len(records), "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "output_tokens": out_tokens, "prompt_tokens": sum(r.prompt_tokens for r in done),
        "prefix_hit_rate": _hit_rate(done),
        "output_tok_per_s": out_tokens / duration, "requests_per_s": len(done) / duration,
        "short_calls": sum(1 for r in done if r.expected_tokens and r.output_tokens != r.expected_tokens),
        "ttft_ms": _dist([r.ttft for r in done]),
        "tpot_ms": _dist([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": _dist([g for r in done for g in r.itls()]),
        "e2e_ms": _dist([r.e2e for r in done]),
        "ttft_p50_ms_by_quarter": ttft_by_quarter(done),
    }
    structured = [r for r in done if r.structured]
    if structured and len(structured) < len(done):   # a mix: each kind's latencies apart
        for name, part in (("plain", [r for r in done if not r.structured]), ("structured", structured)):
            out[name] = {"calls": len(part), "ttft_ms": _dist([r.ttft for r in part]),
                         "tpot_ms": _dist([t for r in part if (t := r.tpot) is not None])}
    later = [r for r in done if r.turn > 0]
    if later:   # a session's later turns: what a prefix cache serves from the earlier ones
        out["later_turns"] = {"calls": len(later), "ttft_ms": _dist([r.ttft for r in later]),
                              "prefix_hit_rate": _hit_rate(later)}
        known = [r for r in later if r.earlier_tokens > 0 and r.cached_tokens >= 0]
        if known:   # of what the turns before left (the new user turn cannot hit), the share found
            out["later_turns"]["earlier_hit_rate"] = \
                sum(r.cached_tokens for r in known) / sum(r.earlier_tokens for r in known)
    if slos:
        good = sum(1 for r in records if meets(r, slos))
        out["goodput"] = {"slos_ms": {k: v * 1000 for k, v in slos.items()}, "good_calls": good,
                          "requests_per_s": good / duration}
    return out


def _hit_rate(done: list[CallRecord]) -> float | None:
    """Prompt tokens the server found cached, of those of the calls that said (None: none did)."""
    said = [r for r in done if r.cached_tokens >= 0]
    prompt = sum(r.prompt_tokens for r in said)
    return sum(r.cached_tokens for r in said) / prompt if said and prompt else None


def format_rows(runs: list[tuple[str, dict]]) -> str:
    """Two tables of a line per run (a rate of a sweep), each within 80 columns: throughput
    and end-to-end latency, then p50/p99 of the token latencies."""
    head = f"{'rate':>8} {'tok/s':>9} {'req/s':>7} {'good/s':>7} {'failed':>6} {'E2E p50/p99 s':>14} {'hits':>5}"
    latency_head = f"{'rate':>8} {'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>16}"
    lines, latencies = [head], [latency_head]
    for rate, s in runs:
        f = lambda d, q: "-" if d[f"p{q}"] is None else f"{d[f'p{q}']:.1f}"
        e = lambda q: "-" if s["e2e_ms"][f"p{q}"] is None else f"{s['e2e_ms'][f'p{q}'] / 1000:.2f}"
        ttft = "/".join(f(s["ttft_ms"], q) for q in PERCENTILES)
        good = f"{s['goodput']['requests_per_s']:.2f}" if "goodput" in s else "-"
        lines.append(f"{rate:>8} {s['output_tok_per_s']:9,.0f} {s['requests_per_s']:7.2f} {good:>7} "
                     f"{s['failed']:>6} {e(50) + '/' + e(99):>14} {_percent(s.get('prefix_hit_rate')):>5}")
        latencies.append(f"{rate:>8} {ttft:>22} {f(s['tpot_ms'], 50) + '/' + f(s['tpot_ms'], 99):>16} "
                         f"{f(s['itl_ms'], 50) + '/' + f(s['itl_ms'], 99):>16}")
    return "\n".join(lines + [""] + latencies)


def ttft_by_quarter(done: list[CallRecord]) -> list[float | None]:
    """TTFT p50 (ms) of the calls sent in each quarter of the run's sending window: a server
    that keeps up holds it, one whose queue grows raises it quarter by quarter."""
    if not done:
        return [None] * 4
    first, last = min(r.start for r in done), max(r.start for r in done)
    span = max(last - first, 1e-9)
    quarters: list[list[float]] = [[], [], [], []]
    for r in done:
        quarters[min(3, int(4 * (r.start - first) / span))].append(r.ttft)
    return [float(np.percentile(q, 50)) * 1000 if q else None for q in quarters]


# A run whose server completed fewer requests a second than this share of the offered rate,
# or whose TTFT p50 grew this many times from the first quarter of its sends to the last (and
# by more than QUEUE_GROWTH_MS), did not keep up: its latencies measure the server's queue
# more than its speed. A shortfall in completions alone, with TTFT held, is the run's tail:
# a run ends with its longest request.
KEEP_UP_SHARE = 0.9
QUEUE_GROWTH = 2.0
QUEUE_GROWTH_MS = 50.0


def keep_up_warnings(runs: list[tuple[str, dict]], calls_per_request: float = 1.0) -> list[str]:
    """A line for each run at a finite rate that the server did not keep up with, or whose
    completions fell short of the rate only because of its tail.
    `calls_per_request`: a session of several turns is one request of the rate."""
    out = []
    for rate, s in runs:
        if rate == "inf":
            continue
        offered, achieved = float(rate), s["requests_per_s"] / calls_per_request
        q = s.get("ttft_p50_ms_by_quarter") or [None] * 4
        grew = q[0] is not None and q[-1] is not None and q[-1] > QUEUE_GROWTH * q[0] \
            and q[-1] - q[0] > QUEUE_GROWTH_MS
        trend = "" if q[0] is None or q[-1] is None else \
            f"TTFT p50 {q[0]:.0f} ms for the first quarter of its calls, {q[-1]:.0f} ms for the last"
        short = f"the server completed {achieved:.2f} requests/s of the {offered:g} offered ({achieved / offered:.0%})"
        if grew:
            out.append(f"rate {rate}: it did not keep up ({short}; {trend}): this rate's latencies include "
                       f"its queue")
        elif achieved < KEEP_UP_SHARE * offered:
            out.append(f"rate {rate}: {short}, " + (
                f"but held {trend}: the shortfall is the run's tail (it ends with its longest request), "
                f"not a queue" if trend else "and its latencies may include its queue"))
    return out


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
