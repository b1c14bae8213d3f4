"""The pipeline path of `qmigrate bench`: a router and N worker processes over ZeroMQ, fed
by this process the way ingest feeds them (every request at time 0), with tokens taken on the
detokenizer's socket and timestamped as they arrive."""

from __future__ import annotations

import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from qmigrate.ops import trace
from qmigrate.bench.timeline import PathResult, Progress, Timeline, frozen_heap

# Pipeline paths by the link their sockets use: ipc, plain tcp on 127.0.0.1, tcp with CURVE.
PIPELINE_LINKS = {"pipeline": "ipc", "pipeline-tcp": "tcp", "pipeline-curve": "curve"}


def _over_tcp(data: dict, tmp: str, curve: bool) -> None:
    """Move a one-node ipc topology onto loopback tcp, with keys for node "local" when `curve`."""
    import socket
    socks = [socket.socket() for _ in range(4 + len(data["workers"]))]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    data.update(transport="tcp", ipc_dir=None, nodes=[{"name": "local", "address": "127.0.0.1"}],
                security={"enabled": "on" if curve else "off", "keys_dir": f"{tmp}/keys"})
    data["router"].update(port=ports[0], telemetry_port=ports[1])
    data["ingest"]["port"], data["detokenizer"]["port"] = ports[2], ports[3]
    for w, port in zip(data["workers"], ports[4:]):
        w["kv_port"] = port
    if curve:
        from qmigrate.wire.security import generate_keys
        generate_keys(f"{tmp}/keys", "local")


def run_pipeline(model_path: str, devices: list[str], dtype: str, requests, max_seqs: int,
                 max_tokens: int, router_overrides: dict, log_level: str,
                 steps_per_dispatch: int = 1, runner: str = "auto", name: str = "pipeline",
                 faults: bool = False, trace_dir: Path | None = None,
                 worker_overrides: dict | None = None, load_format: str = "auto") -> PathResult:
    import zmq
    from qmigrate.wire import security, transport
    from qmigrate.config import dump_topology, parse_topology
    from qmigrate.launch import start_roles, stop, wait_for_fleet

    link = PIPELINE_LINKS[name]
    with tempfile.TemporaryDirectory(prefix="qm-bench-") as tmp:
        data = {
            "transport": "ipc", "ipc_dir": tmp, "model": {"path": model_path, "dtype": dtype, "load_format": load_format},
            "nodes": [{"name": "local"}], "trace_dir": str(trace_dir) if trace_dir is not None else None,
            "router": {"node": "local", "max_queued": max(4096, len(requests) + 64), **router_overrides},
            "ingest": {"node": "local"}, "detokenizer": {"node": "local"},
            "workers": [{"name": f"w{i}", "node": "local", "device": d, "max_num_seqs": max_seqs,
                         "max_num_batched_tokens": max_tokens, "steps_per_dispatch": steps_per_dispatch, "runner": runner,
                         "gpu_memory_utilization": 0.9 / devices.count(d), **(worker_overrides or {})}
                        for i, d in enumerate(devices, 1)],
        }
        if link != "ipc":
            _over_tcp(data, tmp, curve=link == "curve")
        topo = parse_topology(data, source="bench")
        path = Path(tmp) / "topology.yaml"
        dump_topology(topo, path)
        # This process is ingest and detokenizer of node "local": it uses that node's keys.
        transport.secure(security.keyring(topo, "local"))
        collector = transport.socket(zmq.PULL, bind=topo.endpoint("detokenizer").bind, hwm=1_000_000)
        roles = [("router", "router")] + [("worker", w.name) for w in topo.workers]
        children = start_roles(topo, path, roles, read_stdin=False, log_level=log_level)
        try:
            if not wait_for_fleet(topo, children, len(devices), timeout_s=600):
                raise RuntimeError("the benchmark fleet did not start")
            router = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect,
                                      identity="bench-ingest")
            warm = [(list(range(10, 10 + 16 * (i + 1))), 4) for i in range(len(devices) * 4)]
            _drive(router, collector, warm, id_base=1 << 40, name="warm-up", quiet=True)
            before = _stats(topo)
            hook = None
            if faults:
                from qmigrate.bench.faults import Faults
                hook = Faults(topo, children, devices)
            try:
                with frozen_heap():
                    timeline = _drive(router, collector, requests, id_base=0, name=name, hook=hook)
            finally:
                if hook is not None:
                    hook.close()
            end = timeline.end
            time.sleep(1.0)  # one more heartbeat, so the busy/idle counters cover the run
            after = _stats(topo)
            moves = {k.removeprefix("migrations_"): after.get(k, 0) - before.get(k, 0)
                     for k in after if k.startswith("migrations_")}
            chained = after.get("chained_rows", 0) - before.get("chained_rows", 0)
            rows = after.get("leased_rows", 0) - before.get("leased_rows", 0)
            print(f"  router: {rows} rows leased, {chained} of them chained to a batch in flight",
                  file=sys.stderr)
            # The counters travel with heartbeats: `after`, a second past the end, covers the run.
            # Idle time counts the wait after the run too, so busy time is set against the run.
            run_s = end - timeline.t0
            for w in topo.workers:
                busy = (after.get(f"busy_ms_{w.name}", 0) - before.get(f"busy_ms_{w.name}", 0)) / 1000
                if busy > 0:
                    print(f"  {w.name}: running leases {busy:.2f} s of the run's {run_s:.2f} s "
                          f"({min(1.0, busy / run_s):.0%})", file=sys.stderr)
            result = timeline.result(name, end, {k: v for k, v in moves.items() if v})
            result.move_delay_ms = {k.removeprefix("move_delay_ms_"): v for k, v in after.items()
                                    if k.startswith("move_delay_ms_")}
            delays = result.move_delay_ms
            causes = sorted({k.partition("_")[2] for k in delays})
            if causes:
                print("  move delay, decision to the first lease on the new worker, p50/max ms: " + ", ".join(
                    f"{c} {delays.get('p50_' + c, 0):.1f}/{delays.get('max_' + c, 0):.1f}" for c in causes),
                    file=sys.stderr)
            print(f"  the longest request ({max(n for _, n in requests)} tokens) ended {result.longest_request_s:.2f} s "
                  f"into the run's {result.seconds:.2f} s", file=sys.stderr)
            return result
        finally:
            stop(children)
            collector.close(linger=0)
            transport.secure(None)
            if trace_dir is not None:
                print("\n".join(f"  {line}" for line in trace.summarize(trace_dir)), file=sys.stderr)


def _stats(topo) -> dict:
    from qmigrate.wire import protocol as P
    from qmigrate.wire import transport
    return transport.request(topo.endpoint("router").connect, P.StatsRequest(), timeout_s=5.0,
                             expect=P.Stats).counters


def _drive(router, collector, requests, *, id_base: int, name: str, quiet: bool = False, hook=None) -> Timeline:
    """Submit every request at once (as ingest does) and timestamp tokens as they arrive;
    `hook`, if given, is called with the fraction of the tokens received so far."""
    import zmq
    from qmigrate.wire import protocol as P
    from qmigrate.wire import codec
    from qmigrate.wire import transport
    lengths = [n for _, n in requests]
    specs = [P.SeqSpec(id_base + i + 1, P.pack_i32(p), len(p), n, seed=i)
             for i, (p, n) in enumerate(requests)]
    timeline = Timeline(lengths, time.monotonic())
    progress = None if quiet else Progress(name, sum(lengths), len(requests))
    pending = deque(specs)
    in_flight = 0
    while timeline.num_done < len(requests):
        if pending and not in_flight:
            batch = [pending[i] for i in range(P.submit_count(pending))]
            transport.send(router, P.Submit(batch))
            in_flight = len(batch)
        got = transport.recv(router, 0) if in_flight else None
        if got is not None and isinstance(got[1], P.SubmitAck):
            for _ in range(got[1].num_accepted):
                pending.popleft()
            in_flight = 0
        if not collector.poll(50 if not pending else 1):
            continue
        while True:
            try:
                msg = codec.decode(collector.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(msg, P.Tokens):
                now = time.monotonic()
                for sid, n in zip(P.unpack_i64(msg.seq_ids).tolist(), P.unpack_i32(msg.counts).tolist()):
                    timeline.add(sid - id_base - 1, n, now)
        if progress:
            progress.update(sum(timeline.count), timeline.num_done, len(pending))
        if hook is not None:
            hook(sum(timeline.count) / max(1, sum(lengths)))
    timeline.end = time.monotonic()
    if progress:
        progress.close()
    return timeline
