"""`qmigrate status`: the fleet as the router sees it, as a live table, one snapshot or JSON."""

from __future__ import annotations

import json
import sys
import time

from qmigrate.wire import protocol as P
from qmigrate.wire import transport
from qmigrate.ops.observe import GPU_COLUMNS, WORKER_COLUMNS, as_dicts, hit_rate

GIB = 2**30


def fetch(endpoint: str, timeout_s: float) -> dict:
    """One snapshot: {"router": counters, "workers": [...], "gpus": [...]}; raises Unreachable."""
    reply = transport.request(endpoint, P.StatsRequest(), timeout_s=timeout_s, expect=P.Stats)
    return {"router": dict(sorted(reply.counters.items())),
            "workers": as_dicts(WORKER_COLUMNS, reply.workers), "gpus": as_dicts(GPU_COLUMNS, reply.gpus)}


def _gib(n) -> str:
    return f"{n / GIB:.1f}" if isinstance(n, int) and n >= 0 else "-"


def _gib_pair(used, total) -> str:
    """used/total GiB, without decimals from 10 GiB on (narrow enough for 80 columns)."""
    if not (isinstance(used, int) and isinstance(total, int) and used >= 0 and total > 0):
        return "-"
    digits = 0 if total >= 10 * GIB else 1
    return f"{used / GIB:.{digits}f}/{total / GIB:.{digits}f}"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n / 1e3:.0f}k" if n >= 10_000 else str(n)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _kv(w: dict) -> str:
    used, total = w["kv_used_tokens"], w["kv_total_tokens"]
    if not total:
        return "-"
    return f"{100 * used / total:.0f}% {_count(total)}" if used >= 0 else f"? {_count(total)}"


def kv_tiers(workers: list[dict]) -> list[str]:
    """Per worker with a host tier: blocks held and hit on each tier, and GiB copied to the
    host tier and back."""
    out = []
    for w in sorted(workers, key=lambda w: (w["node"], w["name"])):
        if w.get("host_blocks", -1) < 0:
            continue
        out.append(f"  {w['name']} gpu {_count(w['gpu_blocks'])}/{_count(w['gpu_hits'])}, host "
                   f"{_count(w['host_blocks'])}/{_count(w['host_hits'])}, "
                   f"{w['host_bytes_in'] / GIB:.1f}/{w['host_bytes_out'] / GIB:.1f}")
    return out


def render(snap: dict, endpoint: str):
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c = snap["router"]
    moves = ", ".join(f"{k.removeprefix('migrations_')} {v}" for k, v in c.items()
                      if k.startswith("migrations_") and v) or "none"
    rate = hit_rate(c.get("prefix_prompt_tokens", 0), c.get("prefix_cached_tokens", 0))
    cache = "-" if rate is None else f"{100 * rate:.0f}%"
    head = Text(f"router {endpoint}\nqueue {c.get('queued', 0)}   live {c.get('live', 0)}   "
                f"finished {c.get('finished', 0)}   workers {c.get('workers', 0)}   prefix hits {cache}\n"
                f"migrations: {moves}")
    gpus = {g["uuid"]: g for g in snap["gpus"]}
    # No vertical rules and one space between columns: a whole row fits in 80 columns.
    compact = dict(title_justify="left", box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    workers = Table(title="workers (KV in tokens)", **compact)
    for col in ("node", "worker", "device", "state", "GPU GiB", "KV", "owned", "leased", "batch", "tok/s"):
        workers.add_column(col, justify="right" if col in ("owned", "leased", "batch", "tok/s") else "left",
                           overflow="fold")
    for w in sorted(snap["workers"], key=lambda w: (w["node"], w["name"])):
        g = gpus.get(w["gpu_uuid"])
        mem = _gib_pair(g["used_bytes"], g["total_bytes"]) if g else "-"
        style = None if w["state"] == "up" else "yellow" if w["state"] != "dead" else "dim"
        workers.add_row(w["node"], w["name"], w["device"], w["state"], mem, _kv(w), str(w["owned"]),
                        str(w["leased"]), str(w["batch_size"]), f"{w['tokens_per_s']:,.0f}", style=style)
    parts = [head, workers]
    hits = [f"{w['name']} {_percent(hit_rate(w.get('prompt_tokens', 0), w.get('cached_tokens', 0)))}"
            for w in sorted(snap["workers"], key=lambda w: (w["node"], w["name"])) if w.get("prompt_tokens")]
    if hits:
        parts.append(Text("prefix cache hits: " + ", ".join(hits)))
    if tiers := kv_tiers(snap["workers"]):
        parts.append(Text("KV tiers (blocks held/hit, GiB to host and back):\n" + "\n".join(tiers)))
    if gpus:
        table = Table(title="GPUs (GiB)", **compact)
        for col in ("node", "index", "uuid", "used", "free", "total", "util %"):
            table.add_column(col, overflow="fold")
        for g in sorted(gpus.values(), key=lambda g: (g["node"], g["index"])):
            table.add_row(g["node"], str(g["index"]), g["uuid"][:12], _gib(g["used_bytes"]), _gib(g["free_bytes"]),
                          _gib(g["total_bytes"]), str(g["util_percent"]) if g["util_percent"] >= 0 else "-")
        parts.append(table)
    return Group(*parts)


def run_status(endpoint: str, *, once: bool, as_json: bool, interval_s: float, timeout_s: float) -> int:
    from rich.console import Console
    from rich.live import Live

    try:
        snap = fetch(endpoint, timeout_s)
    except transport.Unreachable as exc:
        print(f"error: router not reachable: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(snap, indent=1))
        return 0
    console = Console()
    if once:
        console.print(render(snap, endpoint))
        return 0
    with Live(render(snap, endpoint), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                try:
                    live.update(render(fetch(endpoint, timeout_s), endpoint))
                except transport.Unreachable as exc:
                    from rich.text import Text
                    live.update(Text(f"router not reachable: {exc}", style="red"))
        except KeyboardInterrupt:
            return 0
