"""Step timelines (`qmigrate/ops/trace.py`): off by default, written as JSON lines when on, and
read back into the figures that locate a pipeline's gaps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qmigrate.ops import trace


def test_tracing_is_off_unless_the_topology_names_a_folder(tmp_path):
    from qmigrate.config import local_topology
    assert local_topology().trace_dir is None
    off = trace.tracer("worker-w1", None)
    off("launch", 3)
    off.flush()
    assert off is trace.OFF and not list(tmp_path.iterdir())
    on = trace.tracer("worker-w1", str(tmp_path / "run"))
    on("launch", 3)
    on("collect_end")
    assert not list((tmp_path / "run").iterdir())  # kept in memory until a flush
    on.flush()
    on.flush()                                     # nothing new: nothing written twice
    lines = [json.loads(line) for line in on.path.read_text().splitlines()]
    assert [line[1:] for line in lines] == [["launch", 3], ["collect_end"]]
    assert lines[0][0] <= lines[1][0] and on.path.name.startswith("worker-w1-")


def _events(*items):
    return [[t, kind, *fields] for t, kind, *fields in items]


def test_a_traced_role_stopped_by_sigterm_writes_its_last_stretch_first(tmp_path):
    code = ("import sys, time\n"
            "from qmigrate.ops import trace\n"
            "t = trace.tracer('worker-w1', sys.argv[1])\n"
            "trace.flush_on_sigterm(t)\n"
            "t('launch', 3)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert not list(tmp_path.glob("*.jsonl"))   # nothing written yet
        proc.send_signal(15)
        assert proc.wait(20) == -15                  # it still ends as SIGTERM ends it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    [path] = tmp_path.glob("worker-w1-*.jsonl")
    assert [json.loads(line)[1:] for line in path.read_text().splitlines()] == [["launch", 3]]


def test_the_worker_summary_counts_device_gaps_and_host_waits():
    # Lease 1's first step is on the device at 1 ms; it runs 3 steps, the host waiting 0.5 ms
    # for the device at each collect. After its last collect (8.5 ms) nothing is on the
    # device until lease 2's step at 15 ms (6.5 ms, listed as 4 ms after the lease arrived),
    # nor after that step's collect (3.5 ms). The span ends with lease 2's finish at 20 ms.
    events = _events(
        (0.000, "lease", 1, 3, 4, 0), (0.000, "start_begin", 1), (0.001, "start_end", 1),
        (0.002, "launch", 4), (0.003, "collect_begin", 4), (0.0035, "collect_end"),
        (0.004, "launch", 4), (0.005, "collect_begin", 4), (0.0055, "collect_end"),
        (0.008, "collect_begin", 4), (0.0085, "collect_end"), (0.010, "finish_end", 1),
        (0.011, "lease", 2, 1, 4, 0), (0.015, "start_end", 2), (0.016, "collect_begin", 4),
        (0.0165, "collect_end"), (0.020, "finish_end", 2))
    text = "\n".join(trace.worker_summary("worker-w1", events))
    assert "4 steps in 0.019 s (4.75 ms a step), 2 leases (1 of several steps)" in text
    assert "no step on the device 10 ms (52.6%); 2 stretches over 2 ms, longest 4.0 ms" in text
    assert "host waited for the device 2 ms (10.5%); host time 4.25 ms a step" in text
    assert trace.worker_summary("worker-w2", _events((0.0, "ask", 1))) == ["worker-w2: no lease ran"]


def test_the_worker_summary_times_the_masks_and_counts_those_had_before_the_next_step():
    events = _events(
        (0.000, "lease", 1, 3, 4, 0), (0.001, "start_end", 1), (0.002, "launch", 4),
        (0.003, "masks", 2, 0.0010, 0.0001, 1), (0.004, "collect_begin", 4), (0.0045, "collect_end"),
        (0.005, "masks", 4, 0.0030, 0.0020, 0), (0.006, "collect_begin", 4), (0.0065, "collect_end"),
        (0.007, "masks", 3, 0.0020, 0.0002, 1), (0.008, "finish_end", 1))
    text = "\n".join(trace.worker_summary("worker-w1", events))
    assert ("3 steps waited for masks (3 constrained rows p50): filled in p50 2.00 ms, p90 3.00; "
            "waited for p50 0.20 ms, p90 2.00; sampled before the next step was built in 2") in text, text


def test_the_worker_summary_takes_an_admission_apart():
    # A step ends at 10 ms; the prompt lease 3 arrives 1 ms later, takes 2.5 ms to start, and
    # lease 4 is started behind it (1.4 ms) before its step is collected at 16 ms.
    events = _events(
        (0.008, "start_begin", 2), (0.009, "start_end", 2), (0.009, "finish_begin", 2),
        (0.009, "collect_begin", 4), (0.010, "collect_end"), (0.0102, "finish_end", 2),
        (0.011, "lease", 3, 1, 5, 1), (0.0115, "start_begin", 3), (0.014, "start_end", 3),
        (0.0135, "lease", 4, 16, 5, 0), (0.0141, "start_begin", 4), (0.0155, "start_end", 4),
        (0.0156, "finish_begin", 3), (0.0157, "collect_begin", 5), (0.016, "collect_end"),
        (0.0165, "finish_end", 3))
    lines = trace.worker_summary("worker-w1", events)
    assert "  step to step p50 6.00 ms, p90 6.00, p99 6.00" in lines
    assert ("  1 leases with prompts: last step's end to theirs p50 6.00 ms, p90 6.00; parts (p50): waiting "
            "for the lease 1.00, its start 2.50, leases started behind it first 1.40") in lines


def test_the_worker_summary_sets_steps_that_admit_prompts_apart():
    # Steps of 1 ms, but two of 5 ms that admitted a prompt (300 and 500 new tokens), and one
    # of 4 ms that admitted none; a prompts event of no rows is no admission.
    t, items = 0.0, [(0.0, "collect_end")]
    for ms, prompt in [(1, 0), (5, 300), (1, 0), (4, 0), (1, 0), (5, 500), (1, 0), (1, 0)]:
        t += ms / 1000
        items.append((t - 0.0001, "prompts", 1 if prompt else 0, prompt, 0))
        items.append((t, "collect_end"))
    lines = trace._step_lines(_events(*items))
    assert ("  2 steps admitted prompts (new tokens p50 400): 5.00 ms a step on average, 1.50 ms without; "
            "2 of the 3 steps over twice the median admitted") in lines


def test_the_router_summary_pairs_each_request_with_its_grant():
    events = _events((0.0, "request", "w1", 1), (0.0, "request", "w2", 1), (0.001, "grant", "w1", 7, 4, 1, 1),
                     (0.004, "grant", "w2", 8, 4, 1, 1), (0.005, "request", "w1", 2),
                     (0.007, "grant", "w1", 9, 4, 16, 2), (0.009, "result", "w1", 7))
    [line] = trace.router_summary("router", events)
    assert "3 leases; a request waited for its lease p50 2.00 ms, p90 4.00 ms, max 4.0 ms" in line


def test_the_token_path_after_the_router_is_timed_hop_by_hop(tmp_path):
    router = _events((0.0, "request", "w1", 1), (0.001, "grant", "w1", 7, 4, 1, 1), (0.002, "tokens", "w1", 4),
                     (0.004, "tokens", "w1", 4), (0.010, "tokens", "w1", 4))
    lines = trace.router_summary("router", router)
    assert lines[1] == "  tokens of w1 forwarded: 3, gaps p50 6.00 p90 6.00 p99 6.00 max 6.0 ms"
    (tmp_path / "ingest-5.jsonl").write_text("".join(json.dumps([t, "in", 2]) + "\n" for t in (1.0, 1.002, 1.003)))
    (tmp_path / "detokenizer-4.jsonl").write_text(json.dumps([1.0, "in", 4]) + "\n")
    assert trace.summarize(tmp_path) == ["detokenizer-4: messages in: 1",
                                         "ingest-5: messages in: 3, gaps p50 2.00 p90 2.00 p99 2.00 max 2.0 ms"]


def _bench_trace(tmp_path, tiny_model_dir):
    return tmp_path, subprocess.run([sys.executable, "-m", "qmigrate", "bench", "--paths", "pipeline",
                                     "--requests", "8", "--trace", str(tmp_path)],
                                    capture_output=True, text=True, timeout=170, env=dict(os.environ))


@pytest.mark.timeout(180)
@pytest.mark.early(scenario=_bench_trace, beside="test_shared_prefix.py")   # in-process tests on one core
def test_bench_trace_writes_a_timeline_per_role_and_prints_its_summary(early_run):
    tmp_path, out = early_run.result()
    assert out.returncode == 0, out.stderr[-3000:]
    files = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "pipeline-1").glob("*.jsonl"))
    assert files == ["router", "worker-w1"]
    assert "worker-w1-" in out.stderr and " steps in " in out.stderr and "a request waited for its lease" in out.stderr


def test_a_bench_serve_report_cuts_the_trace_into_its_runs(tmp_path):
    """`python -m qmigrate.ops.trace DIR REPORT`: each run of the report summarized from the
    events within its window alone (steps of 2 ms in the first run, 5 ms in the second)."""
    def lease(t0, step_ms, steps):
        items, t = [(t0, "start_end", 1)], t0
        for _ in range(steps):
            items += [(t + 0.0001, "collect_begin", 8), (t + step_ms / 1000, "collect_end")]
            t += step_ms / 1000
        return items + [(t, "finish_end", 1)]

    events = _events(*lease(10.0, 2, 50), *lease(20.0, 5, 20))
    (tmp_path / "worker-w1-7.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"runs": [
        {"rate": "inf", "t0_monotonic": 9.99, "duration_s": 0.2, "output_tok_per_s": 4000.0},
        {"rate": "inf", "t0_monotonic": 19.99, "duration_s": 0.2, "output_tok_per_s": 1600.0}]}))
    lines = trace.summarize_runs(tmp_path, report)
    assert lines[0] == "run 1 (rate inf): 0.20 s, 4,000 tok/s" and lines[1].startswith("  worker-w1-7: 50 steps in")
    second = lines.index("run 2 (rate inf): 0.20 s, 1,600 tok/s")
    assert lines[second + 1].startswith("  worker-w1-7: 20 steps in 0.100 s (5.00 ms a step)")
    out = subprocess.run([sys.executable, "-m", "qmigrate.ops.trace", str(tmp_path), str(report)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines() == lines
    report.write_text(json.dumps({"runs": [{"rate": "inf", "duration_s": 1.0, "output_tok_per_s": 1.0}]}))
    with pytest.raises(ValueError, match="no t0_monotonic"):
        trace.summarize_runs(tmp_path, report)
