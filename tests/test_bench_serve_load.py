"""`qmigrate bench serve`'s loads for migration: long outputs for a share of the requests,
bursts that arrive together, rates as shares of the saturating rate, and the server's
counters read from its /metrics around each run."""

from __future__ import annotations

import math

import pytest
from aiohttp import web

from qmigrate.bench import serve_data as D
from qmigrate.bench.core import Workload
from qmigrate.bench.serve import Share, parse_rates, request_offsets, run_serve
from qmigrate.bench.serve_metrics import parse, run_counts
from test_bench_serve import FakeServer


def test_a_share_of_requests_gets_long_outputs_within_the_context():
    reqs = D.random_dataset(Workload(2000, (100, 900), (10, 50), vocab=(10, 100), seed=3))
    out = D.with_long_outputs(reqs, 0.1, (2048, 4096), seed=5)
    long = [r for r in out if r.output_len >= 2048]
    assert 150 <= len(long) <= 250 and all(r.output_len <= 4096 for r in long)
    assert [r.prompt for r in out] == [r.prompt for r in reqs]
    assert all(a.output_len == b.output_len for a, b in zip(reqs, out) if b.output_len < 2048)
    assert D.with_long_outputs(reqs, 0.1, (2048, 4096), seed=5) == out        # seeded
    cut = D.with_long_outputs(reqs, 0.1, (2048, 4096), seed=5, max_model_len=2048)
    assert max(r.prompt_len + r.output_len for r in cut) <= 2048
    assert sum(1 for a, b in zip(out, cut) if a.output_len != b.output_len) == len(long)
    with pytest.raises(ValueError, match="long-output-fraction"):
        D.with_long_outputs(reqs, 1.5, (1, 2))


def test_bursts_share_a_document_and_arrive_together():
    reqs = D.burst_dataset(bursts=5, per_burst=8, prefix_len=64, suffix_len=4, output_len=(20, 40), seed=2)
    assert len(reqs) == 40 and {r.burst for r in reqs} == set(range(5))
    for b in range(5):
        group = [r.prompt for r in reqs if r.burst == b]
        assert all(p[:64] == group[0][:64] for p in group) and len({tuple(p) for p in group}) == 8
    assert reqs[0].prompt[:64] != reqs[8].prompt[:64]
    assert all(20 <= r.output_len <= 40 and r.prompt_len == 68 for r in reqs)
    offsets = request_offsets(reqs, 80.0, seed=1)
    times = [sorted({o for r, o in zip(reqs, offsets) if r.burst == b}) for b in range(5)]
    assert all(len(t) == 1 for t in times) and len({t[0] for t in times}) == 5
    # 80 requests/s in bursts of 8: a burst every 0.1 s on average
    many = D.burst_dataset(bursts=4000, per_burst=8, prefix_len=2, suffix_len=1, seed=2)
    last = max(request_offsets(many, 80.0, seed=1))
    assert last == pytest.approx(3999 * 0.1, rel=0.05)
    plain = D.random_dataset(Workload(10, (4, 8), (3, 9), vocab=(10, 100)))
    assert len(set(request_offsets(plain, 50.0))) == 10


def test_rates_as_shares_of_the_saturating_rate():
    rates = parse_rates("inf,0.5x,0.8x,1x")
    assert rates[0] == math.inf and [float(r) for r in rates[1:]] == [0.5, 0.8, 1.0]
    assert all(isinstance(r, Share) for r in rates[1:])
    with pytest.raises(ValueError, match="needs an inf run before it"):
        parse_rates("0.8x,inf")
    with pytest.raises(ValueError, match="0.8y"):
        parse_rates("inf,0.8y")


METRICS_BEFORE = """# HELP qmigrate_migrations_total Sequences moved
qmigrate_migrations_total{cause="load"} 2.0
qmigrate_migrations_by_mechanism_total{mechanism="transfer"} 2.0
qmigrate_kv_transfer_bytes_total 1000.0
qmigrate_preemptions_total 1.0
qmigrate_resends_total 2.0
qmigrate_prefix_prompt_tokens_total{worker="w1"} 100.0
qmigrate_prefix_cached_tokens_total{worker="w1"} 50.0
"""
METRICS_AFTER = """qmigrate_migrations_total{cause="load"} 7.0
qmigrate_migrations_total{cause="memory"} 3.0
qmigrate_migrations_by_mechanism_total{mechanism="transfer"} 6.0
qmigrate_migrations_by_mechanism_total{mechanism="recompute"} 4.0
qmigrate_kv_transfer_bytes_total 5000.0
qmigrate_preemptions_total 4.0
qmigrate_resends_total 7.0
qmigrate_prefix_prompt_tokens_total{worker="w1"} 300.0
qmigrate_prefix_prompt_tokens_total{worker="w2"} 100.0
qmigrate_prefix_cached_tokens_total{worker="w1"} 250.0
qmigrate_generated_tokens_total{worker="w2"} 42.0
"""


def test_the_counters_of_a_run_are_the_growth_between_two_scrapes():
    c = run_counts(parse(METRICS_BEFORE), parse(METRICS_AFTER))
    assert c["migrations"] == 8 and c["migrations_by_cause"] == {"load": 5, "memory": 3}
    assert c["migrations_by_mechanism"] == {"transfer": 4, "recompute": 4}
    assert (c["kv_bytes_shipped"], c["preemptions"], c["resends"]) == (4000, 3, 5)
    assert (c["prefix_prompt_tokens"], c["prefix_cached_tokens"]) == (300, 200)
    assert c["prefix_hit_rate"] == pytest.approx(200 / 300) and c["tokens_by_worker"] == {"w2": 42}


class MetricsServer(FakeServer):
    """The fake server, with a /metrics whose counters grow from one read to the next."""

    def __init__(self):
        self.pages = iter([METRICS_BEFORE, METRICS_AFTER] * 4)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/metrics", self.metrics)
        super().__init__(app=app)

    async def metrics(self, request):
        return web.Response(text=next(self.pages))


def test_a_run_reports_the_servers_counters_and_runs_at_a_share_of_saturation(tmp_path):
    fake = MetricsServer()
    try:
        reqs = D.random_dataset(Workload(8, (4, 8), (3, 9), vocab=(10, 100)))
        runs = run_serve(base_url=fake.url, model=None, requests=reqs, rates=parse_rates("inf,0.5x"), warmup=0,
                         metrics_url=fake.url + "/metrics")
    finally:
        fake.close()
    (inf_label, inf), (label, half) = runs
    assert inf_label == "inf" and half["share_of_saturation"] == 0.5
    assert float(label) == pytest.approx(0.5 * inf["requests_per_s"], rel=0.01)
    for s in (inf, half):
        assert s["server"]["migrations_by_cause"] == {"load": 5, "memory": 3} and s["server"]["preemptions"] == 3
        assert s["completed"] == 8 and s["t0_monotonic"] > 0
