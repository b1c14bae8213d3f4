"""`qmigrate serve`: the topology it builds from its flags, and the real command on the CPU
with the tiny model (health 503 then 200, a completion, SIGTERM stops every process and ends
open streams with an error event and [DONE])."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

import warm

from conftest import node_tmpdir, reserve_ports  # noqa: E402
from qmigrate.config import local_topology
from qmigrate.serve import MAX_HTTP_PROCESSES, ServeOptions, default_api_servers, local_url, serve_topology
import helpers as H  # noqa: E402
from test_signals import _alive, _kill_session, _wait


# --- the topology -------------------------------------------------------------------------

def test_one_worker_per_visible_gpu_with_the_monitor_and_the_flags():
    opts = ServeOptions(host="0.0.0.0", port=9001, served_model_name="m", gpu_memory_utilization=0.8,
                        max_num_seqs=256, api_key="k")
    topo = serve_topology(opts, num_gpus=3)
    assert [(w.name, w.device, w.max_num_seqs, w.gpu_memory_utilization) for w in topo.workers] == [
        (f"gpu{i}", f"cuda:{i}", 256, 0.8) for i in range(3)]
    assert topo.node("local").monitor
    i = topo.ingest
    assert (i.http_host, i.http_port, i.model_name, i.api_key) == ("0.0.0.0", 9001, "m", "k")


def test_cpu_workers_when_there_is_no_gpu_and_defaults_where_no_flag_is_given():
    topo = serve_topology(ServeOptions(cpu_workers=3), num_gpus=0)
    assert [w.device for w in topo.workers] == ["cpu"] * 3
    assert not topo.node("local").monitor
    defaults = local_topology(1).workers[0]
    assert topo.workers[0].max_num_seqs == defaults.max_num_seqs
    assert (topo.ingest.http_host, topo.ingest.http_port, topo.ingest.api_key) == ("127.0.0.1", 8000, None)
    assert topo.ingest.http_processes == 1


def test_trace_names_the_topologys_trace_dir(tmp_path):
    assert serve_topology(ServeOptions(), num_gpus=0).trace_dir is None
    assert serve_topology(ServeOptions(trace_dir=str(tmp_path)), num_gpus=0).trace_dir == str(tmp_path)


def test_migration_policy_and_metrics_port_set_the_routers_settings():
    from qmigrate.config import ConfigError
    topo = serve_topology(ServeOptions(router_settings={"policy": "pinned"}, metrics_port=9300), num_gpus=0)
    assert (topo.router.policy, topo.router.metrics_port, topo.detokenizer.metrics_port) == ("pinned", 9300, 9301)
    default = serve_topology(ServeOptions(), num_gpus=0)
    assert (default.router.policy, default.router.metrics_port) == ("affinity", None)
    with pytest.raises(ConfigError, match="router.policy: expected one of"):
        serve_topology(ServeOptions(router_settings={"policy": "off"}), num_gpus=0)


def test_api_server_count_sets_the_ingest_http_processes():
    assert serve_topology(ServeOptions(api_server_count=4), num_gpus=0).ingest.http_processes == 4
    assert serve_topology(ServeOptions(api_server_count=3), num_gpus=2).ingest.http_processes == 3


def test_gpu_serving_gets_an_http_process_per_four_cores_and_at_most_four_per_gpu(monkeypatch):
    assert [default_api_servers(1, cores) for cores in (2, 4, 8, 16, 64)] == [1, 1, 2, 4, 4]
    assert [default_api_servers(2, cores) for cores in (16, 32, 64)] == [4, 8, 8]
    assert default_api_servers(0, 64) == 1      # CPU workers need the cores
    assert default_api_servers(64, 4096) == MAX_HTTP_PROCESSES
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert serve_topology(ServeOptions(), num_gpus=1).ingest.http_processes == 4


def test_gpu_workers_default_to_a_serving_engines_batch_and_the_flag_overrides_it():
    from qmigrate.config import GPU_SERVE_MAX_NUM_BATCHED_TOKENS as TOKENS, GPU_SERVE_MAX_NUM_SEQS
    topo = serve_topology(ServeOptions(), num_gpus=2)
    assert [(w.max_num_seqs, w.max_num_batched_tokens) for w in topo.workers] == [(256, TOKENS)] * 2
    assert GPU_SERVE_MAX_NUM_SEQS == 256   # vLLM's max_num_seqs
    topo = serve_topology(ServeOptions(max_num_seqs=48), num_gpus=1)
    assert (topo.workers[0].max_num_seqs, topo.workers[0].max_num_batched_tokens) == (48, TOKENS)
    # on GPUs of 70 GiB or more (vLLM's rule), 1,024 sequences; the flag still decides
    big = serve_topology(ServeOptions(), num_gpus=1, gpu_bytes=80 << 30).workers[0]
    assert big.max_num_seqs == 1024
    assert serve_topology(ServeOptions(), num_gpus=1, gpu_bytes=48 << 30).workers[0].max_num_seqs == 256
    assert serve_topology(ServeOptions(max_num_seqs=48), num_gpus=1, gpu_bytes=80 << 30).workers[0].max_num_seqs == 48
    cpu = serve_topology(ServeOptions(), num_gpus=0).workers[0]
    defaults = local_topology(1).workers[0]
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (defaults.max_num_seqs, defaults.max_num_batched_tokens)
    # the CPU worker's settings as the service has run them: 64 rows of 8,192 new tokens, a
    # backlog of prompts spread over 4 steps, a 2 GiB pool, CUDA graphs and the prefix cache on
    engine = cpu.engine_config()
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.prefill_spread_steps) == (64, 8192, 4)
    assert (engine.cpu_kvcache_space_bytes, engine.enforce_eager, engine.enable_prefix_caching) == (2 << 30, False, True)


def test_worker_settings_reach_every_worker_and_bad_ones_are_refused():
    from qmigrate.config import ConfigError, worker_settings
    opts = ServeOptions(worker_settings=worker_settings(["prefill_tokens_per_step=1024", "max_num_seqs=32"]))
    topo = serve_topology(opts, num_gpus=2)
    assert [(w.prefill_tokens_per_step, w.max_num_seqs) for w in topo.workers] == [(1024, 32)] * 2
    with pytest.raises(ConfigError, match="prefill_tokens_per_step"):
        worker_settings(["prefill_tokens_per_step=-1"])
    with pytest.raises(ConfigError, match="no_such"):
        worker_settings(["no_such=1"])


def test_a_config_keeps_its_workers_and_takes_the_flags():
    base = local_topology(2, device="cuda")
    topo = serve_topology(ServeOptions(port=8123, max_num_seqs=32), base, num_gpus=8)
    assert [(w.name, w.device, w.max_num_seqs) for w in topo.workers] == [("w1", "cuda", 32), ("w2", "cuda", 32)]
    kept = serve_topology(ServeOptions(), base, num_gpus=8).workers[0]   # its own settings, not serve's
    assert (kept.max_num_seqs, kept.max_num_batched_tokens) == (base.workers[0].max_num_seqs, base.workers[0].max_num_batched_tokens)
    assert topo.ingest.http_port == 8123


def _serve_cli(monkeypatch, *args):
    """`qmigrate serve` on the CPU up to the topology it would run: (exit code, output, topology)."""
    from typer.testing import CliRunner

    import qmigrate.cli as cli
    import qmigrate.serve as serve
    seen = {}

    def run_serve(topo, model_path, log_level="warning"):
        seen["topo"] = topo
        return 0
    monkeypatch.setattr(serve, "run_serve", run_serve)
    monkeypatch.setattr(serve, "visible_gpus", lambda: 0)
    monkeypatch.setattr(cli, "find_model", lambda name: name)
    result = CliRunner().invoke(cli.app, ["serve", "m", "--port", str(reserve_ports(1)[0]), *args])
    return result.exit_code, result.output, seen.get("topo")


def test_serve_flags_set_the_workers_engine_settings_with_the_topologys_checks(monkeypatch):
    code, _, topo = _serve_cli(monkeypatch, "--max-num-seqs", "12", "--max-num-batched-tokens", "256",
                               "--max-model-len", "128", "--block-size", "8", "--no-enable-prefix-caching",
                               "--enforce-eager", "--gpu-memory-utilization", "0.5")
    assert code == 0
    for w in topo.workers:
        e = w.engine_config()
        assert (e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len, e.block_size) == (12, 256, 128, 8)
        assert (e.enable_prefix_caching, e.enforce_eager, e.gpu_memory_utilization) == (False, True, 0.5)
    code, _, topo = _serve_cli(monkeypatch)
    assert code == 0 and topo.workers[0].engine_config() == local_topology(1).workers[0].engine_config()
    for flag, value, field in (("--max-num-seqs", "0", "max_num_seqs"), ("--block-size", "12", "block_size"),
                               ("--gpu-memory-utilization", "1.5", "gpu_memory_utilization")):
        code, out, _ = _serve_cli(monkeypatch, flag, value)
        assert code == 2 and f"workers[0].{field}: expected" in out, out


def test_a_wildcard_host_is_reached_on_the_loopback():
    assert local_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert local_url("::", 80) == "http://[::1]:80"
    assert local_url("10.0.0.5", 80) == "http://10.0.0.5:80"


def test_serve_without_a_model_or_config_says_what_it_needs(qmigrate):
    run = qmigrate("serve", timeout=60)
    assert run.returncode == 2 and "give a MODEL" in run.stderr


def test_a_taken_port_is_one_line_before_anything_starts(qmigrate, tiny_model_dir):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = qmigrate("serve", str(tiny_model_dir), "--port", str(port), timeout=60)
    assert run.returncode == 1 and run.stderr.startswith(f"error: cannot serve on 127.0.0.1:{port}"), run.stderr
    assert "serving" not in run.stderr


# --- the real command -----------------------------------------------------------------------

def _get(port: int, path: str, timeout_s: float = 2.0) -> tuple[int | None, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    except (OSError, http.client.HTTPException):
        return None, {}
    finally:
        conn.close()


def _complete(port: int, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _stream(port: int, results: list, started: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                               "Authorization": "Bearer k"})
    resp = conn.getresponse()
    events = [resp.readline()]
    started.set()
    events += resp.read().split(b"\n")
    conn.close()
    results.append([e for e in events if e.startswith(b"data: ")])


def _as_a_user(**env) -> dict:
    """This process's environment less what the suite sets for itself (Triton's interpreter,
    which a user's CPU node does not run), plus `env`."""
    return {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **env}


def _serve_on_the_cpu(tmp_path, tiny_model_dir) -> None:
    """The test below, run beside other tests (conftest's `early` lane): a cold start is mostly
    one process importing, on one core."""
    (port,) = reserve_ports(1)
    with node_tmpdir() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "qmigrate", "serve", str(tiny_model_dir), "--port", str(port),
                                 "--cpu-workers", "1", "--served-model-name", "tiny", "--api-key", "k"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_as_a_user(TMPDIR=str(tmp)), start_new_session=True)
        try:
            seen = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                status, body = _get(port, "/health")
                seen.append(status)
                if status == 200:
                    break
                if status == 503:
                    assert body["status"] == "starting" and body["workers"] == 0
                time.sleep(0.1)
            if seen[-1] != 200 and proc.poll() is not None:
                pytest.fail(f"never healthy: {seen[-5:]}, exit {proc.returncode}; "
                            f"stderr: {proc.stderr.read()[-3000:]}")
            assert seen[-1] == 200, f"never healthy: {seen[-5:]}, exit {proc.poll()}"
            assert set(seen) <= {None, 503, 200}
            assert proc.stdout.readline().startswith(f"ready: http://127.0.0.1:{port}")
            status, body = _complete(port, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4})
            assert status == 401  # --api-key
            status, body = _complete(port, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4},
                                     {"Authorization": "Bearer k"})
            assert status == 200 and body["usage"]["completion_tokens"] == 4, body
            roles = [pid for pid in H.roles_of(proc).values() if pid != proc.pid]
            assert len(roles) >= 4, H.roles_of(proc)  # router, ingest, detokenizer, the worker
            assert any(d.name.startswith("qm-serve-") for d in tmp.iterdir()), "the node's directory is not in TMPDIR"
            results: list = []
            started = [threading.Event() for _ in range(16)]  # 8,000 tokens: still running at the signal
            clients = [threading.Thread(target=_stream, args=(port, results, e)) for e in started]
            for c in clients:
                c.start()
            assert all(e.wait(60) for e in started)
            proc.send_signal(signal.SIGTERM)
            for c in clients:
                c.join(60)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 128 + signal.SIGTERM, err
            # no role ends in the interpreter's teardown noise
            assert "Traceback" not in err and "leaked" not in err, err
            # Streams cut by the shutdown end with an error event and [DONE], as finished ones do.
            assert len(results) == 16 and all(r[-1] == b"data: [DONE]" for r in results), results
            cut = [json.loads(r[-2].removeprefix(b"data: ")) for r in results if b'"error"' in r[-2]]
            assert cut and all(e["error"]["code"] == "shutdown" for e in cut), results
            assert _wait(lambda: not _alive(roles), 10), f"roles left running: {_alive(roles)}"
            assert list(tmp.iterdir()) == [], "the temp directory was left behind"
        finally:
            _kill_session(proc)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.early(scenario=_serve_on_the_cpu, beside="test_http_limits.py")
def test_serve_on_the_cpu_answers_once_ready_and_sigterm_stops_everything(early_run):
    early_run.result()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_is_ready_only_once_every_worker_has_joined(tiny_model_dir, tmp_path, node_tmp):
    """Ready means every worker serve started is up (as vLLM's): with one of two CPU workers
    held stopped before it joins, /health stays 503 and no "ready:" prints while the other
    serves the router; once it joins, both come."""
    from qmigrate.config import load_topology
    from qmigrate.wire import protocol as P
    from qmigrate.wire import transport
    (port,) = reserve_ports(1)
    err_path = tmp_path / "serve.err"
    with open(err_path, "w") as err_file:
        # its temp directories in node_tmp: the session is killed at the end, so serve cannot remove them
        proc = warm.popen(["serve", str(tiny_model_dir), "--port", str(port),
                          "--cpu-workers", "2"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=err_file, text=True, start_new_session=True,
                          env={**os.environ, "TMPDIR": str(node_tmp)})
    try:
        assert _wait(lambda: re.search(r"qmigrate status (\S+)", err_path.read_text()), 60), err_path.read_text()
        router = load_topology(re.search(r"qmigrate status (\S+)", err_path.read_text()).group(1)
                               ).endpoint("router").connect

        def workers_at_router():
            try:
                return transport.request(router, P.StatsRequest(), timeout_s=1, expect=P.Stats).counters["workers"]
            except transport.Unreachable:
                return None

        def worker_pids():
            return {m.group(1): pid for title, pid in H.roles_of(proc).items()
                    if (m := re.search(r"\bworker (\S+)", title))}
        assert _wait(lambda: len(worker_pids()) == 2, 30), H.roles_of(proc)
        held = worker_pids()[max(worker_pids())]
        os.kill(held, signal.SIGSTOP)   # still importing torch: it has not joined
        try:
            assert workers_at_router() in (None, 0, 1)
            assert _wait(lambda: workers_at_router() == 1, 90), err_path.read_text()
            time.sleep(1.0)   # several of ingest's polls of the router
            status, body = _get(port, "/health")
            assert status == 503 and body["status"] == "starting", (status, body)
            assert not select.select([proc.stdout], [], [], 0)[0], "ready before every worker joined"
        finally:
            os.kill(held, signal.SIGCONT)
        assert proc.stdout.readline().startswith(f"ready: http://127.0.0.1:{port}"), err_path.read_text()
        assert workers_at_router() == 2
        status, body = _get(port, "/health")
        assert status == 200 and body["workers"] == 2, body
    finally:
        _kill_session(proc)


def test_a_worker_that_never_joins_stops_the_start_with_a_clear_error(capsys, tmp_path):
    from qmigrate.config import local_topology
    from qmigrate.launch import wait_for_fleet
    started = time.monotonic()
    assert not wait_for_fleet(local_topology(2, ipc_dir=str(tmp_path)), [], 2, timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert "only 0 of 2 workers joined the router within 0.3 s (nodes[].join_timeout_s)" in capsys.readouterr().err


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_serve_on_the_gpus_with_defaults_answers_with_the_monitor_on(tiny_model_dir, tmp_path):
    """No flag but the port: a worker per GPU whose KV pool fills it, the VRAM monitor's reports
    at the router, and still a completion (the fleet's own memory is not pressure)."""
    from qmigrate.config import load_topology
    from qmigrate.wire import protocol as P
    from qmigrate.wire import transport
    (port,) = reserve_ports(1)
    err_path = tmp_path / "serve.err"
    with open(err_path, "w") as err_file:  # a file: nothing blocks on a full pipe while it serves
        proc = subprocess.Popen([sys.executable, "-m", "qmigrate", "serve", str(tiny_model_dir), "--port", str(port)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                start_new_session=True)
    try:
        assert _wait(lambda: (re.search(r"qmigrate status (\S+)", err_path.read_text())), 120), \
            err_path.read_text()
        topology = re.search(r"qmigrate status (\S+)", err_path.read_text()).group(1)
        assert proc.stdout.readline().startswith(f"ready: http://127.0.0.1:{port}")
        router = load_topology(topology).endpoint("router").connect

        def stats():
            return transport.request(router, P.StatsRequest(), timeout_s=5, expect=P.Stats)
        assert _wait(lambda: stats().gpus, 30), "no VRAM report reached the router"
        time.sleep(2.0)  # a few more reports, each applied to the workers' admission
        status, body = _complete(port, {"model": tiny_model_dir.name, "prompt": [5, 6, 7], "max_tokens": 8})
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
        import torch
        from qmigrate.ops.observe import WORKER_COLUMNS, as_dicts
        reply = stats()
        assert reply.counters["workers"] == torch.cuda.device_count()
        workers = as_dicts(WORKER_COLUMNS, reply.workers)
        assert all(w["state"] == "up" for w in workers), workers  # not memory-short, may take prompts
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        proc.communicate(timeout=60)
        err = err_path.read_text()
        assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
    finally:
        _kill_session(proc)


def test_a_long_tmpdir_puts_a_local_run_s_sockets_under_tmp(tmp_path, monkeypatch):
    """An ipc:// socket's path has room for 107 bytes: under a TMPDIR too long for them (a
    test's own temp directory is one) a local run's directory goes in /tmp instead, and is
    removed afterwards as always."""
    import tempfile
    from pathlib import Path

    from qmigrate.launch import run_local
    long = tmp_path / ("d" * 90)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    seen = {}

    def start(local, path):
        seen["dir"] = local.ipc_dir
        local.check_endpoints()
        return 0

    assert run_local(local_topology(2), "model", start) == 0
    assert seen["dir"].startswith("/tmp/qm-") and not Path(seen["dir"]).exists()
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert run_local(local_topology(2), "model", start) == 0
    assert Path(seen["dir"]).parent == Path(tempfile.gettempdir())   # a short one is kept


def test_ready_waits_for_the_metrics_endpoints_too(monkeypatch):
    """A script that waits for "ready:" may scrape /metrics at once: the notice prints only when
    /health answers 200 and so does every Prometheus endpoint serve was given."""
    import io
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from qmigrate import serve as S

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    monkeypatch.setattr(S, "READY_POLL_S", 0.0)
    api = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    metrics_port = H.free_port()
    out = io.StringIO()
    notice = S.ReadyNotice("127.0.0.1", api.server_address[1], out, metrics=(("", metrics_port),))
    servers = [api]
    try:
        notice()
        assert not notice.is_ready and out.getvalue() == ""   # /health answers, /metrics does not yet
        servers.append(ThreadingHTTPServer(("127.0.0.1", metrics_port), Ok))
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        notice()
        assert notice.is_ready and out.getvalue().startswith(f"ready: http://127.0.0.1:{api.server_address[1]}")
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
