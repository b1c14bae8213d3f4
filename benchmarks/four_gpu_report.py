"""The summary of `benchmarks/four_gpu.py`: each moving policy against moves off, and a short
table of every part's figures (pure: from the results dict)."""

from __future__ import annotations

import math

PARTS = ("migration", "drain", "tp70b", "tp70b-tp2", "scaling")


def ratios(res: dict) -> None:
    """Per load, each moving policy against moves off: TTFT p99 off / on, tok/s on / off."""
    for data in res["workloads"].values():
        for by_policy in data.get("points", {}).values():
            off = by_policy.get("pinned")
            for policy in ("affinity", "any"):
                on = by_policy.get(policy)
                if off and on and on["ttft_p99_ms"] and off["ttft_p99_ms"] and on["tok_per_s"] and off["tok_per_s"]:
                    on["ttft_p99_pinned_over_this"] = off["ttft_p99_ms"] / on["ttft_p99_ms"]
                    on["tok_per_s_this_over_pinned"] = on["tok_per_s"] / off["tok_per_s"]


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(results: dict) -> str:
    lines = []
    for part in PARTS:
        if isinstance(results.get(part), dict) and "error" in results[part]:
            lines.append(f"{part} failed: {str(results[part]['error'])[-300:]}")
    for key, res in (results.get("migration") or {}).items():
        if not isinstance(res, dict) or "workloads" not in res:
            continue
        for wl, data in res["workloads"].items():
            for policy, r in data.get("router", {}).items():
                free = ",".join(f"{w}:{_f(v, '.0f')}" for w, v in r.get("kv_free_blocks_min", {}).items()) or "-"
                lines.append(f"migration {key} {wl} {policy}: router queue max {_f(r.get('queue_max'), '.0f')}, "
                             f"mean {_f(r.get('queue_mean'))}; least free KV blocks {free}")
            sat = data.get("saturation", {})
            lines.append(f"migration {key} {wl}: saturating {_f(sat.get('requests_per_s'))} req/s "
                         f"({_f(sat.get('tok_per_s'), ',.0f')} tok/s)")
            lines.append(f"  {'load':>4} {'policy':>8} {'tok/s':>9} {'TTFT p50/p99 ms':>18} {'ITL p99':>8} "
                         f"{'ev/resend':>9} {'moves (cause; how)':<28} {'MB':>7} {'p99 x':>6} {'tok x':>6}")
            for load, by_policy in data.get("points", {}).items():
                for policy, p in by_policy.items():
                    moves = ",".join(f"{k}{v}" for k, v in sorted((p["migrations"] or {}).items())) or "0"
                    how = ",".join(f"{k[0]}{v}" for k, v in sorted((p["mechanisms"] or {}).items()))
                    lines.append(f"  {load:>4} {policy:>8} {p['tok_per_s']:9,.0f} "
                                 f"{_f(p['ttft_p50_ms']) + '/' + _f(p['ttft_p99_ms']):>18} {_f(p['itl_p99_ms']):>8} "
                                 f"{_f(p['preemptions'], 'd') + '/' + _f(p.get('resends'), 'd'):>9} "
                                 f"{moves + ('; ' + how if how else ''):<28} "
                                 f"{_f((p['kv_bytes_shipped'] or 0) / 1e6, ',.0f'):>7} "
                                 f"{_f(p.get('ttft_p99_pinned_over_this'), '.2f'):>6} "
                                 f"{_f(p.get('tok_per_s_this_over_pinned'), '.2f'):>6}")
    d = results.get("drain")
    if d and "worker" in d:
        lines.append(f"drain {d['worker']} of {d['of_workers']} at {d['drain_at_s']:.1f} s, {d['rate']:.1f} req/s: "
                     f"lost {d['lost']}, repeated {d['repeated']} of {d['calls']}; streams in flight "
                     f"{d['streams_in_flight']}, max pause {_f(d['max_pause_s'], '.3f')} s (p90 "
                     f"{_f(d['pause_p90_s'], '.3f')}; before the drain: max {_f(d['control_max_pause_s'], '.3f')}); "
                     f"tok/s {d['tok_per_s_before']:,.0f} -> {d['tok_per_s_after']:,.0f}, "
                     f"{_f(d['after_over_three_quarters'], '.2f')} of 3/4 saturation")
    for part in ("tp70b", "tp70b-tp2"):
        t = results.get(part)
        if not t or "error" in t:
            continue
        for r in t.get("decode", []):
            lines.append(f"{part} decode batch {r['batch']:>3}: {_f(r['step_ms'], '.2f')} ms, floor of a shard "
                         f"{r['floor_ms']:.2f} ms, {_f(r['x_floor'], '.2f')}x")
        sg = t.get("sharegpt")
        if sg:
            lines.append(f"{part} ShareGPT: {sg['tok_per_s']:,.0f} tok/s, TTFT p50/p99 {_f(sg['ttft_p50_ms'])}/"
                         f"{_f(sg['ttft_p99_ms'])} ms")
    sc = results.get("scaling")
    if sc and "pipeline" in sc:
        for n, r in sc["pipeline"].items():
            lines.append(f"scaling pipeline N={n}: {r['tok_per_s']:,.0f} tok/s"
                         + (f", {r['over_n_times_one']:.3f} of N x one" if "over_n_times_one" in r else ""))
        srv = sc["serve"]
        for name in ("all", "one"):
            if name in srv:
                r = srv[name]
                lines.append(f"scaling serve {r['workers']} worker(s): mixed {r['mixed_tok_per_s']:,.0f} tok/s; "
                             f"shared-prefix hits {_f(r['shared_prefix_hit_rate_usage'], '.3f')} (usage), "
                             f"{_f(r['shared_prefix_hit_rate_router'], '.3f')} (router)")
        if "mixed_all_over_n_times_one" in srv:
            lines.append(f"scaling serve: mixed all / (N x one) {srv['mixed_all_over_n_times_one']:.3f}; hit rate "
                         f"all / one {_f(srv.get('hit_rate_all_over_one'), '.3f')}")
    for s in results.get("skipped", []):
        lines.append(f"skipped: {s}")
    return "\n".join(lines)
