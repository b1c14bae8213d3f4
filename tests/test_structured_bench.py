"""`bench serve`'s structured requests: which requests carry the schema, what they send, and the
plain calls' latencies apart from the structured ones'."""

from __future__ import annotations

import json

import pytest

from qmigrate.bench import serve_data as D
from qmigrate.bench.serve_client import Client
from qmigrate.bench.serve_stats import CallRecord, summarize


@pytest.mark.parametrize("fraction, n, want", [(0.1, 256, 25), (1.0, 64, 64), (0.0, 64, 0), (0.5, 7, 3)])
def test_the_fraction_of_requests_that_carry_the_schema_is_spread_evenly(fraction, n, want):
    reqs = [D.ServeRequest([1, 2, 3], 8) for _ in range(n)]
    D.structure(reqs, D.json_schema_format("builtin"), fraction)
    marked = [i for i, r in enumerate(reqs) if r.response_format is not None]
    assert len(marked) == want
    if len(marked) > 2:   # evenly: no two gaps differ by more than one request
        gaps = [b - a for a, b in zip(marked, marked[1:])]
        assert max(gaps) - min(gaps) <= 1


def test_a_structured_call_sends_the_schema_instead_of_ignore_eos(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "object"}))
    fmt = D.json_schema_format(str(path))
    client = Client("http://127.0.0.1:1", "m")
    plain = json.loads(client.completion_body([1, 2], 16))
    structured = json.loads(client.completion_body([1, 2], 16, fmt))
    assert plain["ignore_eos"] and "response_format" not in plain
    assert "ignore_eos" not in structured and "min_tokens" not in structured
    assert structured["response_format"]["json_schema"]["schema"] == {"type": "object"}
    with pytest.raises(ValueError, match="not JSON"):
        path.write_text("{nope")
        D.json_schema_format(str(path))


def test_a_mixed_run_reports_the_plain_calls_tpot_apart():
    def call(gap: float, structured: bool) -> CallRecord:
        return CallRecord(0.0, [0.1 + gap * i for i in range(5)], output_tokens=5, structured=structured)
    records = [call(0.01, False) for _ in range(9)] + [call(0.05, True)]
    s = summarize(records, 0.0, 1.0)
    assert s["plain"]["calls"] == 9 and s["structured"]["calls"] == 1
    assert s["plain"]["tpot_ms"]["p50"] == pytest.approx(10.0)
    assert s["structured"]["tpot_ms"]["p50"] == pytest.approx(50.0)
    assert "plain" not in summarize(records[:9], 0.0, 1.0)


def test_a_real_node_runs_a_structured_mix_at_full_length(http_node, tmp_path, qmigrate):
    """Half the calls with the builtin schema (which cannot close within the length): every call
    runs its whole length, and the plain calls' figures come apart from the structured ones'."""
    out = tmp_path / "serve.json"
    run = qmigrate("bench", "serve", "--base-url", http_node.url, "--requests", "6", "--prompt-len", "4:16",
                   "--output-len", "6:12", "--vocab", "10:1000", "--max-concurrency", "6",
                   "--response-format-json-schema", "builtin", "--structured-fraction", "0.5", "--json", str(out))
    assert run.returncode == 0, run.stderr
    [r] = json.loads(out.read_text())["runs"]
    assert (r["completed"], r["failed"], r["short_calls"]) == (6, 0, 0), r
    assert r["plain"]["calls"] == 3 and r["structured"]["calls"] == 3
    assert "TPOT p50 plain" in run.stdout
