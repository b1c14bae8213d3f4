"""benchmarks/four_gpu.py: the arithmetic over bench serve's calls (the saturating rate, what a
drain did, a tensor-parallel shard's decode floor), its summary table, and one part run end to
end on the CPU with the tiny model (a drain of one of two workers under load)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import stop_group

from benchmarks.four_gpu_report import table
from benchmarks.four_gpu_lib import RouterSampler, burst_kv_tokens, drain_effects, saturating_rate, shard_floor_ms
from qmigrate.hub.shapes import shape_config


def call(start, chunks, expected=None, error=""):
    return {"start": start, "chunks": chunks, "output_tokens": len(chunks),
            "expected_tokens": len(chunks) if expected is None else expected, "error": error}


def test_the_saturating_rate_leaves_the_tail_out():
    # 10 calls of 10 tokens: 80 tokens in the first second, then one call's 20 slow ones
    calls = [call(0.0, [0.1 * (i + 1) for i in range(10)]) for _ in range(8)]
    calls += [call(0.0, [1.0 + i for i in range(10)]) for _ in range(2)]
    sat = saturating_rate(calls, share_of_tokens=0.8)
    assert sat["tok_per_s"] == pytest.approx(80 / 1.0)
    assert sat["mean_output_tokens"] == 10 and sat["requests_per_s"] == pytest.approx(8.0)
    assert sat["whole_run_requests_per_s"] == pytest.approx(10 / 10.0)
    with pytest.raises(ValueError):
        saturating_rate([call(0.0, [], error="boom")])


def test_a_drain_is_judged_by_lost_and_repeated_calls_pauses_and_tok_s():
    steady = [call(s, [s + 0.01 * i for i in range(1, 200)]) for s in (0.0, 0.5, 1.0)]
    paused = call(0.2, [0.2 + 0.01 * i for i in range(1, 100)] + [1.7 + 0.01 * i for i in range(100)])  # 0.51 s gap
    short = call(0.3, [0.31, 0.32], expected=5)
    twice = call(0.4, [0.41, 0.42, 0.43], expected=2)
    failed = call(0.6, [], expected=4, error="HTTP 500: gone")
    e = drain_effects([*steady, paused, short, twice, failed], drain_at=1.1, before_s=1.0, settle_s=0.1,
                      arrivals_end=2.0)
    assert (e["lost"], e["repeated"], e["calls"]) == (2, 1, 7)
    assert e["lost_errors"] == ["HTTP 500: gone"]
    assert e["streams_in_flight"] == 4 and e["max_pause_s"] == pytest.approx(0.51)
    assert e["control_max_pause_s"] == pytest.approx(0.01, abs=1e-6)
    assert e["tok_per_s_before"] > 0 and e["after_over_before"] == pytest.approx(
        e["tok_per_s_after"] / e["tok_per_s_before"])


def test_a_burst_overflows_one_capped_pool_and_fits_four():
    per, doc, question, out = 256, 1024, 64, "512:1024"
    pool = burst_kv_tokens(per, doc, question, out)
    burst = doc + per * (question + 768)
    assert pool % 16 == 0 and pool < burst <= 2 * pool < 4 * pool
    assert burst_kv_tokens(per, doc, question, "2048:2048") > pool


def test_the_router_sampler_keeps_the_queue_and_each_pools_least_free_blocks():
    r = RouterSampler(None)
    for depth, free in ((0, (90, 50)), (12, (10, 60)), (3, (40, 5))):
        r.add({("qmigrate_queue_depth", ()): float(depth),
               ("qmigrate_kv_blocks_free", (("worker", "w1"),)): float(free[0]),
               ("qmigrate_kv_blocks_free", (("worker", "w2"),)): float(free[1]),
               ("qmigrate_kv_blocks_used", (("worker", "w1"),)): 1.0})
    sm = r.summary()
    assert (sm["samples"], sm["queue_max"], sm["queue_mean"]) == (3, 12.0, 5.0)
    assert sm["kv_free_blocks_min"] == {"w1": 10.0, "w2": 5.0}
    with RouterSampler(None) as idle:   # no URL: nothing sampled, nothing started
        pass
    assert idle.summary()["queue_max"] is None
    text = table({"migration": {"m": {"workloads": {"burst": {"router": {"affinity": sm}}}}}})
    assert "router queue max 12, mean 5.0; least free KV blocks w1:10,w2:5" in text


def test_the_floor_of_one_gpus_shard_of_the_70b_shape():
    config = shape_config("llama-3.1-70b")
    one = shard_floor_ms(config, 1, 1, 512)
    four = shard_floor_ms(config, 4, 1, 512)
    assert one["weight_bytes_per_gpu"] == pytest.approx(141e9, rel=0.02)   # ~70.6 B parameters in bf16
    assert four["floor_ms"] == pytest.approx(one["floor_ms"] / 4)
    big = shard_floor_ms(config, 4, 256, 576)
    # 320 KiB of KV a token (80 layers, 8 KV heads of 128, K and V, bf16), a quarter a GPU
    assert big["kv_bytes_per_gpu"] == pytest.approx(256 * 576 * 327680 / 4)
    assert big["floor_ms"] > four["floor_ms"]


def test_the_table_names_every_figure_and_what_was_skipped():
    point = {"rate": "10", "tok_per_s": 1000.0, "ttft_p50_ms": 10.0, "ttft_p99_ms": 40.0, "itl_p99_ms": 9.0,
             "preemptions": 3, "migrations": {"load": 4}, "mechanisms": {"transfer": 4}, "kv_bytes_shipped": 2e6}
    results = {"migration": {"m": {"workloads": {"burst": {
        "saturation": {"requests_per_s": 12.5, "tok_per_s": 1500.0},
        "points": {"0.8": {"affinity": {**point, "ttft_p99_pinned_over_this": 2.5, "tok_per_s_this_over_pinned": 1.1},
                           "pinned": {**point, "ttft_p99_ms": 100.0, "migrations": {}, "mechanisms": {}}}}}}}},
        "skipped": ["drain (needs ~180 s, 20 s left)"]}
    text = table(results)
    assert "saturating 12.5 req/s" in text and "load4; t4" in text and "2.50" in text and "1.10" in text
    assert "skipped: drain" in text


@pytest.mark.timeout(600)   # two servers' worth of CPU work on a shared machine
def test_the_drain_part_end_to_end_on_the_cpu(tmp_path, tiny_model_dir):
    """Two CPU workers of the tiny model under load, one drained mid-run: nothing lost or
    repeated, the drain moved sequences, and the figures came out."""
    import shutil
    out = tmp_path / "out"
    # the driver's tiny model, the session's (the same build: the driver finds it made)
    shutil.copytree(tiny_model_dir, tmp_path / "work" / "tiny")
    # its own session, stopped with SIGTERM whatever happens: the driver then stops the servers
    # it started (each in a session of its own, out of reach of a signal to this one)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.four_gpu", "drain", "--tiny", "--out", str(out),
                             "--work", str(tmp_path / "work")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=560)
    finally:
        stop_group(proc, grace_s=30)
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads((out / "four-gpu-drain-tiny.json").read_text())["drain"]
    assert result["lost"] == 0 and result["repeated"] == 0 and result["calls"] >= 8
    # the router says what the drained worker held: those move (streams in flight may be the other worker's)
    held = int(re.fullmatch(r"draining w2: (\d+) sequences? to move", result["router_said"]).group(1))
    assert result["run"]["migrations"].get("drain", 0) > 0 or held == 0, result["router_said"]
    assert result["max_pause_s"] is not None and "drain w2 of 2" in stdout


@pytest.mark.parametrize("argv, says", [
    (["migration", "--policies", "affinity,nowhere"], "unknown policy(ies) nowhere"),
    (["migration", "--saturation-rps", "sharegpt"], "--saturation-rps takes WORKLOAD=REQ_PER_S"),
    (["migration", "--saturation-rps", "sharegpt=fast"], "--saturation-rps takes WORKLOAD=REQ_PER_S"),
])
def test_a_bad_policy_or_saturating_rate_is_refused_before_anything_starts(argv, says, tmp_path, capsys):
    from benchmarks import four_gpu
    with pytest.raises(SystemExit) as stop:
        four_gpu.main([*argv, "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert stop.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_servers_ports_are_free_together_and_outside_the_ephemeral_range():
    """`serve --metrics-port P` binds P and P + 1: both must be free, and drawn where no outgoing
    connection takes one as its source port before the server binds it (a detokenizer that
    found P + 1 taken exited, and the node stopped under the driver's load)."""
    import socket
    from benchmarks.four_gpu_lib import free_ports
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(20):
        port = free_ports(1)
        first = free_ports(2, taken=(port,))
        assert port not in (first, first + 1) and first + 1 < low and port < low
        for p in (first, first + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
