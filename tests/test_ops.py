"""Operators' view, in-process: the fleet observer, metrics, status rendering, the router's
answers to drains and to a fleet with no workers, logs, progress and the rough edges."""

from __future__ import annotations

import io
import json
import logging

import pytest
from typer.testing import CliRunner

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.cli import app
from qmigrate.config import parse_topology
from qmigrate.ops.observe import GPU_COLUMNS, WORKER_COLUMNS, FleetObserver, as_dicts

pytestmark = pytest.mark.timeout(60)


def _topo(tmp_path, **router):
    return parse_topology({
        "transport": "ipc", "ipc_dir": str(tmp_path / "ipc"), "nodes": [{"name": "n1"}],
        "router": {"node": "n1", **router}, "ingest": {"node": "n1"}, "detokenizer": {"node": "n1"},
        "workers": [{"name": "w1", "node": "n1"}, {"name": "w2", "node": "n1"}]})


@pytest.fixture
def router(tmp_path):
    """A Router in this process with its replies captured instead of sent."""
    from qmigrate.router.loop import Router
    r = Router(_topo(tmp_path))
    r.sent = []
    r.reply = lambda to, msg: r.sent.append((to, msg))
    yield r
    r.work.close(linger=0)
    r.telemetry.close(linger=0)


def _hello(r, name: str, **info) -> None:
    info = {"device": "cpu", "kv_tokens": 1024, "block_size": 16, "gpu_uuid": f"CPU-{name}", **info}
    r.on_hello(name.encode(), P.Hello("worker", name, info=info))


# --- the router ---------------------------------------------------------------------------

def test_draining_the_last_live_worker_is_refused_with_a_reason(router):
    _hello(router, "w1"), _hello(router, "w2")
    router.on_drain(b"cli", P.Drain("w1"))
    assert router.sent[-1][1].ok
    router.on_drain(b"cli", P.Drain("w2"))
    ack = router.sent[-1][1]
    assert not ack.ok and "last live worker" in ack.message and "\n" not in ack.message
    assert not router.sched.workers["w2"].draining


def test_a_drain_says_how_many_sequences_it_moves(router):
    _hello(router, "w1"), _hello(router, "w2"), _hello(router, "w3")
    router.sched.workers["w2"].owned.update({7, 8, 9})
    router.on_drain(b"cli", P.Drain("w2"))
    assert router.sent[-1][1] == P.DrainAck(True, "draining w2: 3 sequences to move")
    router.on_drain(b"cli", P.Drain("w3"))
    assert router.sent[-1][1] == P.DrainAck(True, "draining w3: 0 sequences to move")


def test_requests_waiting_with_no_worker_are_said_once(router, caplog):
    from qmigrate.router.stranded import STRANDED_NOTICE_S
    router.on_submit(b"ingest", P.Submit([P.SeqSpec(1, P.pack_i32([1, 5, 6]), 3, 4)]))
    with caplog.at_level(logging.WARNING, logger="qmigrate.router"):
        for t in (0.0, 1.0, STRANDED_NOTICE_S + 0.5, STRANDED_NOTICE_S + 10):
            router.notice_stranded(t)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["1 requests are waiting and no worker has joined; they run when a worker joins"]


def test_a_heartbeat_passes_on_the_shipments_that_reached_its_worker(router, monkeypatch):
    _hello(router, "w1")
    told = []
    monkeypatch.setattr(router.sched, "kv_arrived", lambda name, ids: told.append((name, ids)))
    router.on_heartbeat(b"w1", P.Heartbeat("w1", kv_arrived=P.pack_i64([77, 78])))
    router.on_heartbeat(b"w1", P.Heartbeat("w1"))   # nothing arrived: nothing to pass on
    assert told == [("w1", [77, 78])]
    with pytest.raises(P.ProtocolError, match="kv_arrived"):   # the loop drops such a message
        router.on_heartbeat(b"w1", P.Heartbeat("w1", kv_arrived=b"\x01\x02\x03"))


def test_stats_carry_worker_and_gpu_rows(router):
    _hello(router, "w1", prefill_tokens_per_s=41_000)
    router.sched.admit([P.SeqSpec(1, P.pack_i32([1, 5, 6]), 3, 4)])
    router.observer.asked("w1", 1024 - 64)
    router.observer.vram("n1", "CPU-w1", 0, 1000, 960, 40, 7)
    router.sched.set_free_vram("CPU-w1", 0.04)
    router.on_stats(b"cli", P.StatsRequest())
    stats = codec.decode(codec.encode(router.sent[-1][1]))  # survives the wire
    (w,) = as_dicts(WORKER_COLUMNS, stats.workers)
    assert (w["name"], w["node"], w["state"], w["kv_used_tokens"], w["vram_free_fraction"]) == \
        ("w1", "n1", "memory-short", 64, 0.04)
    assert w["prefill_tokens_per_s"] == 41_000   # as its hello said (what a recompute is costed at)
    assert as_dicts(GPU_COLUMNS, stats.gpus)[0]["free_bytes"] == 40
    assert stats.counters["queued"] == 1


# --- observer, metrics, status ------------------------------------------------------------

class _Sched:
    """Just what the observer and metrics read of a Scheduler."""

    def __init__(self):
        from qmigrate.router.scheduler import Scheduler, WorkerState
        self.s = Scheduler()
        self.s.register(WorkerState("w1", 8, 4096, kv_tokens=1600, block_size=16, gpu_uuid="GPU-a"), 0.0)


def test_tokens_per_second_follow_results_and_fall_to_zero_when_idle():
    obs = FleetObserver()
    obs.joined("w1", "n1", "cuda:0", 0.0)
    for t in range(1, 11):
        obs.reported("w1", 100, 800, float(t) * 0.5)
    assert obs.workers["w1"].tokens_per_s == pytest.approx(200.0)
    obs.tick(20.0)
    obs.tick(30.0)
    assert obs.workers["w1"].tokens_per_s == 0.0
    assert obs.workers["w1"].tokens_total == 1000


def test_metrics_follow_the_scheduler_and_observer():
    from prometheus_client import generate_latest

    from qmigrate.ops.metrics import RouterMetrics
    fleet, obs, m = _Sched(), FleetObserver(), RouterMetrics()
    obs.joined("w1", "n1", "cuda:0", 0.0)
    obs.reported("w1", 50, 1600 - 160, 1.0)
    obs.shipped(10, 4096)
    obs.vram("n1", "GPU-a", 0, 80 << 30, 60 << 30, 20 << 30, 90)
    fleet.s.counters.update(migrations_memory=3, migrations_by_transfer=3, stale_results=2, finished=4, evictions=1)
    m.update(fleet.s, obs, {"malformed": 1})
    fleet.s.counters.update(migrations_memory=2, evictions=6)
    m.update(fleet.s, obs, {"malformed": 1})
    text = generate_latest(m.registry).decode()
    for line in ('qmigrate_migrations_total{cause="memory"} 5.0', 'qmigrate_kv_blocks_used{worker="w1"} 10.0',
                 'qmigrate_kv_blocks_free{worker="w1"} 90.0', 'qmigrate_kv_transfer_bytes_total 40960.0',
                 'qmigrate_migrations_by_mechanism_total{mechanism="transfer"} 3.0',
                 'qmigrate_errors_total{kind="stale_result"} 2.0', 'qmigrate_errors_total{kind="malformed"} 1.0',
                 'qmigrate_generated_tokens_total{worker="w1"} 50.0', 'qmigrate_requests_finished_total 4.0',
                 'qmigrate_preemptions_total 7.0',
                 'qmigrate_gpu_memory_free_bytes{gpu="GPU-a",node="n1"} 2.147483648e+10'):
        assert line in text, line


def test_latency_histograms_count_each_finished_request_once():
    from prometheus_client import generate_latest

    from qmigrate.ops.metrics import LatencyMetrics
    m = LatencyMetrics()
    m.finished(10.0, 10.2, 12.2, 11, "length")
    m.finished(10.0, None, 10.5, 0, "eos")
    text = generate_latest(m.registry).decode()
    assert "qmigrate_time_to_first_token_seconds_count 1.0" in text
    assert "qmigrate_time_per_output_token_seconds_sum 0.2" in text
    assert 'qmigrate_requests_total{outcome="length"} 1.0' in text


def test_status_renders_workers_and_gpus():
    from rich.console import Console

    from qmigrate.ops.status import render
    fleet, obs = _Sched(), FleetObserver()
    obs.joined("w1", "n1", "cuda:0", 0.0)
    obs.asked("w1", 800)
    obs.vram("n1", "GPU-a", 0, 80 << 30, 60 << 30, 20 << 30, 90)
    workers, gpus = obs.snapshot(fleet.s)
    snap = {"router": {"queued": 3, "migrations_memory": 2}, "workers": as_dicts(WORKER_COLUMNS, workers),
            "gpus": as_dicts(GPU_COLUMNS, gpus)}
    out = io.StringIO()
    Console(file=out, width=160).print(render(snap, "tcp://head:5550"))
    text = out.getvalue()
    assert "queue 3" in text and "memory 2" in text and "50% 1600" in text
    assert "60/80" in text and "GPU-a" in text


def test_status_fits_80_columns_without_cutting_a_word():
    from rich.console import Console

    from qmigrate.ops.status import render
    uuid = "GPU-5f3a9c2e-1b4d-4e8f-9a7b-0c1d2e3f4a5b"
    row = dict(name="gpu12", node="gpus", device="cuda:12", gpu_uuid=uuid, state="memory-short", owned=1212,
               leased=2560, batch_size=256, tokens_per_s=123456.7, kv_used_tokens=1234567,
               kv_total_tokens=2345678, block_size=16, tokens_total=10**9, vram_free_fraction=0.01)
    gpu = dict(node="gpus", uuid=uuid, index=12, total_bytes=141 << 30, used_bytes=130 << 30,
               free_bytes=11 << 30, util_percent=100)
    snap = {"router": {"queued": 12345, "live": 20000, "finished": 1234567, "workers": 16,
                       "migrations_memory": 3, "migrations_load": 120}, "workers": [row], "gpus": [gpu]}
    out = io.StringIO()
    Console(file=out, width=80).print(render(snap, "tcp://192.168.100.200:5550"))
    text = out.getvalue()
    assert "\u2026" not in text and max(map(len, text.splitlines())) <= 80, text
    for word in ("worker", "device", "state", "GPU GiB", "memory-short", "owned", "leased", "batch", "tok/s",
                 "123,457", "53% 2.3M", "130/141", "util %"):
        assert word in text, (word, text)
    assert "prefix hits -" in text and "prefix cache hits" not in text
    snap["router"].update(prefix_prompt_tokens=1000, prefix_cached_tokens=750)
    row.update(prompt_tokens=400, cached_tokens=100)
    out = io.StringIO()
    Console(file=out, width=80).print(render(snap, "tcp://192.168.100.200:5550"))
    assert "prefix hits 75%" in out.getvalue() and "prefix cache hits: gpu12 25%" in out.getvalue()


# --- CLI, logs, progress -------------------------------------------------------------------

def test_a_wrong_log_level_is_one_line():
    result = CliRunner().invoke(app, ["sim", "--log-level", "loud"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --log-level: expected one of debug, info, warning, error, got 'loud'"


def test_role_logs_name_role_name_and_node(capsys):
    from qmigrate.ops.logs import setup
    try:
        setup("worker", "w1", "gpu3", "info")
        logging.getLogger("qmigrate.worker").info("ready")
    finally:
        logging.getLogger().handlers.clear()
    err = capsys.readouterr()
    assert "qmigrate worker w1 on gpu3: INFO ready" in err.err and err.out == ""


def test_help_reads_whole_at_80_columns():
    result = CliRunner().invoke(app, ["--help"], terminal_width=80, env={"COLUMNS": "80"})
    commands = result.output.split("Commands:")[1].splitlines()
    assert all(not line.endswith("...") for line in commands), result.output
    bench = CliRunner().invoke(app, ["bench", "--help"], terminal_width=80, env={"COLUMNS": "80"}).output
    assert "--steps-per-dispatch" in bench and "decode-step" in bench and "…" not in bench


def test_bench_modes_are_subcommands_whose_options_follow_their_name(monkeypatch, tiny_model_dir):
    bench = CliRunner().invoke(app, ["bench", "--help"], terminal_width=100).output
    commands = bench.split("Commands:")[1]
    assert all(name in commands for name in ("curve", "decode-step", "admission-step", "serve")), bench
    assert "--decode-step" not in bench and "--admission-step" not in bench and "--fake-workers" not in bench
    wrong = CliRunner().invoke(app, ["bench", "--device", "cuda", "decode-step"])
    assert wrong.exit_code == 2 and "--device is an option of the standard run" in wrong.output, wrong.output
    bad = CliRunner().invoke(app, ["bench", "decode-step", "--batches", "1,x"])
    assert bad.exit_code == 2 and "--batches takes comma-separated sizes" in bad.output, bad.output
    assert CliRunner().invoke(app, ["bench", "curve", "--paths", "pipeline"]).exit_code == 2   # curve sets them
    runs = []
    monkeypatch.setattr("qmigrate.bench.core.run_bench", lambda **kw: runs.append(kw))
    for args in (["bench"], ["bench", "curve"]):
        result = CliRunner().invoke(app, [*args, "--model", str(tiny_model_dir), "--requests", "3"])
        assert result.exit_code == 0, result.output
    assert [r["paths"] for r in runs] == [["pipeline", "in-process", "hf-static"], ["pipeline-tcp", "pipeline-curve"]]
    assert [r["workload"].num_requests for r in runs] == [3, 3]


def test_serve_help_gives_the_max_num_seqs_that_serve_uses():
    from qmigrate.config import LARGE_GPU_BYTES
    from qmigrate.serve import serve_max_num_seqs
    text = " ".join(CliRunner().invoke(app, ["serve", "--help"], terminal_width=80, env={"COLUMNS": "80"}).output.split())
    big, small = serve_max_num_seqs(LARGE_GPU_BYTES), serve_max_num_seqs(LARGE_GPU_BYTES - 1)
    assert f"{big} on GPUs of {LARGE_GPU_BYTES >> 30} GiB or more, {small} on smaller ones" in text, text


def test_bench_faults_needs_four_workers_and_says_so():
    result = CliRunner().invoke(app, ["bench", "--faults", "--workers", "3", "--paths", "pipeline"])
    assert result.exit_code == 2 and "--faults needs --workers 4 or more" in result.output, result.output


def test_progress_line_redraws_on_a_terminal_and_is_silent_otherwise():
    from qmigrate.ops.progress import ProgressLine

    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        line = ProgressLine("qmigrate", stream)
        line.show(3, 10, 1234.5, queued=2)
        line.clear()
    assert tty.getvalue() == "\r\x1b[Kqmigrate: 3/10 requests done, queue 2, 1,234 tok/s\r\x1b[K"
    assert pipe.getvalue() == ""


def test_output_at_a_terminal_clears_the_progress_line_first():
    from qmigrate.ops.progress import TerminalWriter

    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        TerminalWriter(stream)("[1] capital\n")
    assert tty.getvalue() == "\r\x1b[K[1] capital\n"
    assert pipe.getvalue() == "[1] capital\n"


def test_the_progress_rate_is_tokens_over_the_time_they_took():
    from qmigrate.ops.progress import TokenRate
    rate = TokenRate(window_s=5.0)
    for tick in range(61):                           # 30 s of loading, sampled every 0.5 s
        assert rate.add(100.0 + tick / 2, 0) == 0.0
    for tick in range(1, 21):                        # then 40 tokens in 10 s
        got = rate.add(130.0 + tick / 2, 2 * tick)
        assert got == pytest.approx(4.0), tick        # from the first tokens on, not 1 tok/s
    assert rate.add(142.0, 40) < 4.0                 # output stopped: the rate falls
    assert rate.add(200.0, 40) == 0.0
    assert rate.add(201.0, 3) == 0.0                 # the total restarted: a fresh start


# --- rough edges ---------------------------------------------------------------------------

def test_a_cuda_device_this_machine_lacks_is_named(tmp_path):
    torch = pytest.importorskip("torch")
    from qmigrate.launch import device_problem
    topo = _topo(tmp_path)
    topo.workers[1].device = f"cuda:{torch.cuda.device_count()}"
    problem = device_problem(topo, "n1")
    assert problem.startswith("workers[1].device: 'cuda:") and "(worker w2)" in problem


def test_an_unreachable_hub_model_is_one_line(monkeypatch):
    import huggingface_hub

    from qmigrate.hub.loading import ModelNotFound, fetch_hub_model

    def offline(name, **kw):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nmore detail")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFound) as info:
        fetch_hub_model("someorg/somemodel")
    assert str(info.value) == ("model 'someorg/somemodel' is not a local directory, and fetching it from the "
                               "Hugging Face hub failed: Got: ConnectError: [Errno -2] Name or service not known")


def test_a_clamped_max_new_tokens_is_said_in_the_final_record():
    from tokenizer_util import build_tokenizer

    from qmigrate.detokenizer.formats import JsonlSink
    from qmigrate.ingest.prompts import Defaults, parse_line
    tok = build_tokenizer()
    prompt = parse_line(json.dumps({"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 100}) + "\n",
                        mode="jsonl", line_no=1, tokenizer=tok, max_context=16, defaults=Defaults(), eos_ids=[1])
    assert prompt.max_new_tokens == 13
    assert prompt.note == "max_new_tokens 100 clamped to 13: the prompt is 3 tokens of the model's 16-token context"
    out = []
    sink = JsonlSink(tok, out.append)
    sink.start(7, "a", [5, 6, 7], note=prompt.note)
    sink.tokens(7, 0, [8])
    sink.finish(7, "length", 1)
    final = json.loads("".join(out).splitlines()[-1])
    assert final["done"] and final["note"] == prompt.note


def test_the_appended_fields_travel_and_old_messages_still_decode():
    stats = P.Stats({"queued": 1}, [["w1", "n1", "cpu", "", "up", 0, 0, 0, 0.0, -1, 0, 16, 0, -1.0]],
                    [["n1", "GPU-a", 0, 10, 4, 6, 50]])
    assert codec.decode(codec.encode(stats)) == stats
    meta = P.RequestMeta(7, "r", P.pack_i32([1, 2]), note="max_new_tokens 9 clamped to 4")
    assert codec.decode(codec.encode(meta)) == meta
    old = codec.encode(P.Stats({"queued": 1}))
    assert codec.decode(old).workers == [] and codec.decode(codec.encode(P.RequestMeta(7, "r", b""))).note == ""
    with pytest.raises(P.ProtocolError):
        codec.decode(codec.encode(P.Stats({}, [["w1", ["nested"]]])))
