"""The router benchmark's fake workers (pure timeline) and one short run of the real router."""

from __future__ import annotations

import json

import pytest

from qmigrate.wire import protocol as P
from benchmarks.router import FleetPoint, cpu_seconds, largest_linear, run_router_bench, sweep_sizes
from benchmarks.fake_fleet import FAKE_TOKEN, FakeDevice

STEP = 0.002


def lease(lease_id: int, seq_ids: list[int], num_steps: int = 1) -> P.Lease:
    n = len(seq_ids)
    return P.Lease(lease_id, lease_id, 10.0, P.pack_i64(seq_ids), P.pack_i32([5] * n), P.pack_i32([1] * n),
                   num_steps=num_steps)


def results(done):
    return [(r.lease_id, P.unpack_i64(r.seq_ids).tolist(), P.unpack_i32(r.counts).tolist()) for r, _ in done]


def test_leases_run_back_to_back_one_token_per_row():
    dev = FakeDevice(STEP)
    dev.add(lease(1, [10, 11, 12]), now=0.0)
    dev.add(lease(2, [13]), now=0.001)       # queued behind lease 1, as on a GPU
    assert dev.lease_ids == [1, 2]
    assert dev.due(0.0019) == []
    assert results(dev.due(0.002)) == [(1, [10, 11, 12], [1, 1, 1])]
    assert dev.next_end() == pytest.approx(0.004)  # started when lease 1 ended, not when it came
    (result, done), = dev.due(0.004)
    assert P.unpack_i32(result.tokens).tolist() == [FAKE_TOKEN]
    assert P.unpack_u8(result.status).tolist() == [P.Finish.NONE]
    assert (done.start, done.num_rows, done.num_tokens) == (pytest.approx(0.002), 1, 1)
    dev.add(lease(3, [10]), now=0.010)       # an idle device starts a lease when it comes
    assert dev.next_end() == pytest.approx(0.012)


def test_multi_step_lease_and_revokes_at_step_boundaries():
    dev = FakeDevice(STEP)
    dev.add(lease(1, [10, 11, 12, 13], num_steps=5), now=0.0)
    dev.add(lease(2, [20, 21], num_steps=3), now=0.0)
    assert not dev.revoke(P.Revoke(99), now=0.001)           # unknown: ignored
    assert dev.next_end() == pytest.approx(0.010)
    assert dev.revoke(P.Revoke(2), now=0.004)                # not started yet: its first step only
    assert dev.revoke(P.Revoke(1, P.pack_i64([11])), now=0.0065)  # during step 4: the lease ends after it
    assert dev.revoke(P.Revoke(1), now=0.0075)               # a second one changes nothing
    (r1, d1), (r2, d2) = dev.due(1.0)
    assert P.unpack_i32(r1.counts).tolist() == [4, 4, 4, 4]
    assert len(P.unpack_i32(r1.tokens)) == 16 and d1.end == pytest.approx(0.008)
    assert P.unpack_i32(r2.counts).tolist() == [1, 1] and d2.end == pytest.approx(0.010)
    assert not dev.revoke(P.Revoke(1), now=1.0)               # finished: ignored


def test_sweep_sizes_and_the_linear_limit():
    assert sweep_sizes("16") == [1, 2, 4, 8, 16]
    assert sweep_sizes("6") == [1, 2, 4, 6]
    assert sweep_sizes("4,2") == [1, 2, 4]
    with pytest.raises(ValueError):
        sweep_sizes("0")
    point = lambda n, s: FleetPoint(n, 0, 0, 0, 0, 0, 0, 0, 1, scaling=s)
    assert largest_linear([point(1, 1.0), point(2, 0.95), point(4, 0.7), point(8, 0.92)]) == 2
    assert largest_linear([point(1, 1.0), point(2, 0.5)]) == 1
    assert cpu_seconds(__import__("os").getpid()) > 0


@pytest.mark.slow
def test_router_bench_runs_the_real_router_with_fake_workers(tmp_path):
    out = tmp_path / "rb.json"
    # One-step leases keep the router working every step, so its CPU shows in whole ticks.
    points = run_router_bench(sizes=[1, 2], step_ms=5.0, batch=8, warmup_s=0.3, window_s=1.0,
                              router_overrides={"max_lease_steps": 1}, json_path=out)
    report = json.loads(out.read_text())
    assert [p["num_workers"] for p in report["points"]] == [1, 2] == [p.num_workers for p in points]
    for p in points:
        assert 0 < p.rows_per_s <= 1.05 * p.ideal_rows_per_s
        assert 0 < p.mean_rows_per_lease <= 8 and 0 < p.device_busy <= 1.0 + 1e-9
        assert p.router_cpu > 0 and p.num_fake_procs == 1
    assert points[0].scaling == 1.0 and report["largest_linear"] >= 1


def test_router_settings_for_a_bench_run_are_checked():
    from qmigrate.config import ConfigError, router_settings
    assert router_settings(["chain_leases=false", "lease_timeout_s=2.5", "policy=any"]) == {
        "chain_leases": False, "lease_timeout_s": 2.5, "policy": "any"}
    for bad, why in (("chain_lease=false", "did you mean 'chain_leases'"), ("policy=none", "expected"),
                     ("max_queued", "KEY=VALUE")):
        with pytest.raises(ConfigError, match=why):
            router_settings([bad])


def test_the_router_bench_refuses_bad_arguments_before_it_starts_anything():
    from benchmarks.router import main
    for argv in (["--workers", "0"], ["--router-setting", "no_such_setting=1"], ["--step-ms", "0"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv


def test_a_probe_runs_as_a_module_from_any_directory(tmp_path):
    """The fake workers and the HTTP probe's client are started as `python -m benchmarks.X`."""
    import subprocess
    from benchmarks import module_command
    argv, env = module_command("fake_fleet", "--help")
    run = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--step-ms" in run.stdout, run.stderr
