"""Keys, the ZAP allow-list and the role table: each attack of issue 10 is repeated and fails.

The attacks run in-process against a real Router (bound CURVE sockets, the real
authenticator) with attacker sockets of their own ZeroMQ context; one test runs two real
nodes over loopback TCP with security forced on."""

from __future__ import annotations

import ast
import json
import logging
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import security, transport
from qmigrate.config import parse_topology
from conftest import reserve_ports, stop_group
import warm

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def _topology(tmp_path, model_dir=None, enabled="on", **extra):
    ports = reserve_ports(7)
    keys = tmp_path / "keys"
    for node in ("head", "gpu1", "gpu2"):
        if not (keys / f"{node}.key").exists():
            security.generate_keys(keys, node)
    data = {
        "transport": "tcp", "model": {"path": str(model_dir) if model_dir else None},
        "security": {"enabled": enabled, "keys_dir": str(keys)},
        "nodes": [{"name": n, "address": "127.0.0.1"} for n in ("head", "gpu1", "gpu2")],
        "router": {"node": "head", "port": ports[0], "telemetry_port": ports[1]},
        "ingest": {"node": "head", "port": ports[2], "reply_port": ports[6]},
        "detokenizer": {"node": "head", "port": ports[3]},
        "workers": [{"name": "w1", "node": "gpu1", "kv_port": ports[4]},
                    {"name": "w2", "node": "gpu2", "kv_port": ports[5]}],
        **extra,
    }
    return data


def _keys(tmp_path, node: str) -> tuple[bytes, bytes]:
    return zmq.auth.load_certificate(tmp_path / "keys" / f"{node}.key_secret")


@pytest.fixture
def secured(tmp_path):
    """A router of a security-on topology, in this process, and a maker of outside clients."""
    from qmigrate.router.loop import Router
    topo = parse_topology(_topology(tmp_path))
    transport.secure(security.keyring(topo, "head"))
    router = Router(topo)
    outside = zmq.Context()
    server_key = _keys(tmp_path, "head")[0]
    monitors: dict = {}

    def client(keys, identity: str | None = None, endpoint: str | None = None, kind=zmq.DEALER):
        sock = outside.socket(kind)
        sock.linger = 0
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
        if identity:
            sock.identity = identity.encode()
        monitors[sock] = sock.get_monitor_socket()
        sock.connect(endpoint or topo.endpoint("router").connect)
        return sock

    client.keys = lambda node: _keys(tmp_path, node)
    client.monitors = monitors
    yield topo, router, client
    outside.destroy(linger=0)
    router.work.close(linger=0)
    router.telemetry.close(linger=0)
    transport.secure(None)


def _pump(router, done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the router never got there"
        if router.work.poll(20):
            router.drain_socket()
        router.serve_parked(time.monotonic())


def _reply(router, sock):
    _pump(router, lambda: sock.poll(0))
    return codec.decode(sock.recv())


def _refused_handshake(client, sock, timeout_s: float = 10.0) -> None:
    monitor = client.monitors[sock]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            event = recv_monitor_message(monitor)["event"]
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, "an unlisted key was let in"
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return
    pytest.fail("no authentication failure seen")


def _logged(caplog, text: str):
    return lambda: any(text in r.getMessage() for r in caplog.records)


def _join(router, client, keys, name: str):
    worker = client(keys, identity=name)
    worker.send(codec.encode(P.Hello("worker", name)))
    _pump(router, lambda: name in router.identity)
    assert isinstance(_reply(router, worker), P.Welcome)
    return worker


SPEC = P.SeqSpec(7, P.pack_i32([1, 5, 9]), 3, 4)
ATTACKS = {"submit": P.Submit([SPEC]), "pull work": P.Hello("worker", "w1"),
           "post results": P.StepResult(1, P.pack_i64([7]), P.pack_i32([1]), P.pack_i32([5]), P.pack_u8([0])),
           "drain": P.Drain("w1")}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_unlisted_key_gets_nothing_and_is_logged_once(secured, attack, caplog):
    topo, router, client = secured
    caplog.set_level(logging.WARNING)
    real = _join(router, client, client.keys("gpu1"), "w1")
    intruder = client(zmq.curve_keypair(), identity="w1" if attack != "submit" else None)
    intruder.send(codec.encode(ATTACKS[attack]))
    _refused_handshake(client, intruder)
    _pump(router, _logged(caplog, "from an unlisted key at 127.0.0.1"))
    router.drain_socket()
    assert not router.sched.seqs and router.identity["w1"] == b"w1"
    assert router.sched.workers["w1"].alive and not router.sched.workers["w1"].draining
    assert not intruder.poll(0)
    assert sum("unlisted key" in r.getMessage() for r in caplog.records) == 1  # retries are not logged again
    real.close()


def test_an_unlisted_key_cannot_push_kv(secured, caplog):
    topo, router, client = secured
    caplog.set_level(logging.WARNING)
    kv = transport.socket(zmq.PULL, bind=topo.endpoint("kv", "w1").bind)
    try:
        for keys in (zmq.curve_keypair(), client.keys("head")):  # head runs no worker
            pusher = client(keys, endpoint=topo.endpoint("kv", "w1").connect, kind=zmq.PUSH)
            pusher.send_multipart([codec.encode(P.KVHeader(1, 7, 1, "float32", [1, 2, 1, 1, 1])), b"\0" * 8])
            _refused_handshake(client, pusher)
        assert not kv.poll(100)
    finally:
        kv.close(linger=0)


def test_listed_keys_in_the_wrong_role_are_refused_and_logged(secured, caplog):
    topo, router, client = secured
    caplog.set_level(logging.WARNING)
    w1 = _join(router, client, client.keys("gpu1"), "w1")
    w1.send(codec.encode(P.Submit([SPEC])))  # a worker that submits
    w1.send(codec.encode(P.Drain("w1")))     # or drains
    _pump(router, _logged(caplog, "refused a Drain from node gpu1"))
    assert _logged(caplog, "refused a Submit from node gpu1")()
    head = client(client.keys("head"), identity="w1x")  # the ingest node posts a step result
    head.send(codec.encode(ATTACKS["post results"]))
    _pump(router, _logged(caplog, "refused a StepResult from node head"))
    impostor = client(client.keys("gpu2"), identity="w2")  # gpu2's key claims gpu1's worker
    impostor.send(codec.encode(P.Hello("worker", "w1")))
    reply = _reply(router, impostor)
    assert isinstance(reply, P.Reject) and "does not run on node gpu2" in reply.reason
    assert not router.sched.seqs and not router.sched.workers["w1"].draining and "w2" not in router.identity
    ingest = client(client.keys("head"), identity="ingest-1")  # the right role is let through
    ingest.send(codec.encode(P.Submit([SPEC])))
    assert isinstance(_reply(router, ingest), P.SubmitAck) and list(router.sched.seqs) == [7]


def test_a_hello_reusing_a_live_workers_name_changes_nothing(secured, caplog):
    topo, router, client = secured
    real = _join(router, client, client.keys("gpu1"), "w1")
    before = (router.identity["w1"], router.sched.workers["w1"].joined_at)
    for keys, identity in ((client.keys("gpu2"), "evil"), (client.keys("gpu1"), "evil2")):
        other = client(keys, identity=identity)
        other.send(codec.encode(P.Hello("worker", "w1")))
        assert isinstance(_reply(router, other), P.Reject)
    assert (router.identity["w1"], router.sched.workers["w1"].joined_at) == before
    assert router.sched.workers["w1"].alive
    real.send(codec.encode(P.WorkRequest(1, 4, 64)))  # the real worker is still served
    _pump(router, lambda: router.parked["w1"])


def test_a_new_zap_handler_waits_for_the_address_of_the_one_before():
    """The old handler's socket closes in zmq's background thread; the new one must not fail
    because the address is still held for a moment (seen between two tests)."""
    ctx = zmq.Context()
    holder = ctx.socket(zmq.REP)
    holder.bind("inproc://zeromq.zap.01")
    ring = security.Keyring("head", b"", b"")
    threading.Timer(0.3, holder.close).start()
    started = time.monotonic()
    auth = ring.start(ctx)
    try:
        assert auth.is_alive() and time.monotonic() - started >= 0.25
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_missing_key_files_name_the_file_and_the_command(tmp_path, tiny_model_dir):
    topo = parse_topology(_topology(tmp_path))
    secret = tmp_path / "keys" / "gpu2.key_secret"
    secret.unlink()
    with pytest.raises(security.SecurityError) as info:
        security.keyring(topo, "gpu2")
    text = str(info.value)
    assert str(secret) in text and f"qmigrate keys generate {tmp_path / 'keys'} --node gpu2" in text
    assert "\n" not in text
    from typer.testing import CliRunner
    from qmigrate.cli import app
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(_topology(tmp_path, tiny_model_dir)))
    refused = CliRunner().invoke(app, ["node", str(path), "--node", "gpu2"])  # refuses before starting roles
    assert refused.exit_code == 1 and "qmigrate keys generate" in refused.output, refused.output
    (tmp_path / "keys" / "gpu1.key").unlink()  # another node's public key: named too
    with pytest.raises(security.SecurityError, match="gpu1.key is missing"):
        security.keyring(topo, "head")
    (tmp_path / "keys" / "head.key_secret").chmod(0o644)
    with pytest.raises(security.SecurityError, match="readable by others"):
        security.keyring(topo, "head")


def test_keys_generate_cli_writes_an_owner_only_secret(tmp_path):
    from typer.testing import CliRunner
    from qmigrate.cli import app
    result = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "k"), "--node", "gpu1"])
    assert result.exit_code == 0, result.output
    secret, public = tmp_path / "k" / "gpu1.key_secret", tmp_path / "k" / "gpu1.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None) and pub.decode() in result.output
    assert zmq.curve_public(sec) == pub
    again = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "k"), "--node", "gpu1"])
    assert again.exit_code == 1 and "--force" in again.output


def test_public_keys_inline_file_or_directory(tmp_path):
    data = _topology(tmp_path)
    pub = _keys(tmp_path, "gpu1")[0]
    for spec in (pub.decode(), str(tmp_path / "keys" / "gpu1.key"), str(tmp_path / "keys")):
        data["nodes"][1]["public_key"] = spec
        assert security.public_key(parse_topology(data), "gpu1") == pub


def test_security_is_on_off_loopback_and_off_only_when_asked(tmp_path):
    data = _topology(tmp_path, enabled="auto")
    assert not parse_topology(data).is_secure  # loopback tcp: the local simulation needs no keys
    data["nodes"][1]["address"] = "10.0.0.7"
    assert parse_topology(data).is_secure
    data["nodes"][1]["address"] = "127.0.0.1"
    data["nodes"][0]["bind"] = "*"  # every interface is off loopback too
    assert parse_topology(data).is_secure
    assert security.open_warning(parse_topology(data)) is None
    off = parse_topology({**data, "security": {"enabled": "off"}})
    assert not off.is_secure and "security.enabled is off" in security.open_warning(off)
    assert not parse_topology({**data, "transport": "ipc", "nodes": data["nodes"][:1],
                               "workers": [{"name": "w1", "node": "head"}]}).is_secure


def test_guard_role_table():
    roles = {"head": frozenset({"router", "ingest", "detokenizer", "operator"}), "gpu1": frozenset({"worker"})}
    detok = security.Guard("detokenizer", roles, {"w1": "gpu1"})
    tokens = P.Tokens(b"", b"", b"", b"", b"")
    # Everything reaches the detokenizer through the router: a worker may not send it tokens.
    assert detok.refusal("head", tokens) is None and detok.refusal("gpu1", tokens) is not None
    assert detok.refusal("gpu1", P.RequestMeta(1, "a", b"")) is not None
    assert detok.refusal("", tokens) is not None  # an unnamed peer runs nothing
    assert detok.refusal("head", P.Drain("w1")) == "Drain is not accepted by the detokenizer"
    router = security.Guard("router", roles, {"w1": "gpu1", "w2": "gpu2"})
    assert router.refusal("gpu1", P.Heartbeat("w1"), identity=b"w1") is None
    assert router.refusal("gpu1", P.Heartbeat("w2"), identity=b"w2") is not None  # w2 runs elsewhere
    assert router.refusal("head", P.Hello("worker", "w1")) is not None
    # A pulse comes from a socket with an identity of its own: the worker it names must run there.
    assert router.refusal("gpu1", P.Pulse("w1"), identity=b"\x00k\x8b") is None
    assert router.refusal("gpu1", P.Pulse("w2"), identity=b"\x00k\x8b") is not None
    assert router.refusal("head", P.Pulse("w1")) is not None
    assert router.refusal("head", P.Hello("ingest", "ingest")) is None
    assert security.Guard("router", None, {}).refusal("", P.Drain("w1")) is None  # security off


BANNED_CALLS = {"eval", "exec", "__import__", "builtins.eval", "builtins.exec", "torch.load", "np.load",
                "numpy.load"}
WIRE_BANNED_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def test_no_module_imports_pickle_or_calls_eval():
    found = []
    for path in sorted((ROOT / "qmigrate").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n in WIRE_BANNED_MODULES]
            if isinstance(node, ast.Call):
                f = node.func  # a module's .eval() (torch's eval mode) is not the builtin
                if isinstance(f, ast.Name):
                    call = f.id
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                    call = f"{f.value.id}.{f.attr}"
                else:
                    call = ""
                if call in BANNED_CALLS:
                    found.append(f"{path.name}:{node.lineno} calls {call}")
    assert not found, found


def test_receiving_sockets_bound_message_size_and_queues():
    sock = transport.socket(zmq.PULL)
    try:
        assert sock.getsockopt(zmq.MAXMSGSIZE) == P.MAX_MESSAGE_BYTES
        assert sock.getsockopt(zmq.RCVHWM) > 0 and sock.getsockopt(zmq.SNDHWM) > 0
    finally:
        sock.close(linger=0)


def test_a_model_with_its_own_code_names_the_setting(tmp_path, tiny_model_dir):
    import shutil
    from qmigrate.hub.loading import ModelLoadError
    from qmigrate.hub.tokenizer_info import load_tokenizer_info
    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="qm-custom", auto_map={"AutoConfig": "configuration_qm.QMConfig"})
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="set model.trust_remote_code: true"):
        load_tokenizer_info(remote)
    assert parse_topology(_topology(tmp_path)).model.trust_remote_code is False


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_nodes_over_loopback_with_security_on(tmp_path, tiny_model_dir):
    data = _topology(tmp_path, tiny_model_dir)
    data["ingest"]["input"] = data["detokenizer"]["output"] = "jsonl"
    data["workers"] = data["workers"][:1]
    path = tmp_path / "secure.yaml"
    path.write_text(yaml.safe_dump(data))
    prompts = [{"id": f"p{i}", "prompt_ids": [1, 5 + i, 70, 300 + i], "max_new_tokens": 4} for i in range(3)]
    gpu_err = open(tmp_path / "gpu1.err", "a+")
    gpu = warm.popen(["node", str(path), "--node", "gpu1"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=gpu_err,
                     start_new_session=True)
    try:
        head = warm.popen(["node", str(path), "--node", "head", "--stdin"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = head.communicate("".join(json.dumps(p) + "\n" for p in prompts), timeout=180)
        finally:
            stop_group(head)   # when it hung
        assert head.returncode == 0, err[-3000:]
        finals = {r["id"]: r for r in map(json.loads, out.splitlines()) if r.get("done")}
        assert sorted(finals) == [p["id"] for p in prompts]
        assert all(len(finals[p["id"]]["token_ids"]) == p["max_new_tokens"] for p in prompts)
        assert "refused" not in err
    finally:
        stop_group(gpu)
    gpu_err.seek(0)
    assert "refused" not in gpu_err.read()


def test_bench_curve_path_runs_a_secured_loopback_topology(tmp_path):
    from qmigrate.bench.pipeline import _over_tcp
    data = {"transport": "ipc", "ipc_dir": str(tmp_path), "nodes": [{"name": "local"}],
            "router": {"node": "local"}, "ingest": {"node": "local"}, "detokenizer": {"node": "local"},
            "workers": [{"name": "w1", "node": "local"}, {"name": "w2", "node": "local"}]}
    plain = {k: (dict(v) if isinstance(v, dict) else [dict(x) for x in v] if isinstance(v, list) else v)
             for k, v in data.items()}
    _over_tcp(data, str(tmp_path), curve=True)
    _over_tcp(plain, str(tmp_path / "plain"), curve=False)
    topo = parse_topology(data)
    assert topo.is_secure and topo.endpoint("router").bind.startswith("tcp://127.0.0.1:")
    ring = security.keyring(topo, "local")
    assert set(ring.clients) == set(security.SENDERS)
    assert ring.server_keys[topo.endpoint("kv", "w2").connect] == ring.public
    assert not parse_topology(plain).is_secure and security.keyring(parse_topology(plain), "local") is None


def test_bench_link_round_trips_with_and_without_curve():
    from qmigrate.bench.link import round_trip_us
    assert round_trip_us(256, 5, curve=True) > 0 and round_trip_us(256, 5, curve=False) > 0
    assert not transport.is_secure()  # the process is plain again afterwards


def test_status_reaches_a_router_with_security_on(secured, tmp_path):
    import threading
    topo, router, _ = secured
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo.to_dict()))
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            if router.work.poll(20):
                router.drain_socket()
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        cmd = [sys.executable, "-m", "qmigrate", "status", str(path), "--json", "--timeout", "10"]
        for extra in ([], ["--as-node", "head"]):
            run = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stderr
            assert "queued" in json.loads(run.stdout)["router"]
        run = subprocess.run(cmd + ["--as-node", "nowhere"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stderr.startswith("error: no node named 'nowhere'"), run.stderr
    finally:
        stop.set()
        thread.join()


def test_an_in_process_socket_needs_no_key_at_either_end(tmp_path):
    """The HTTP server wakes ingest over inproc://: with security on both ends stay plain."""
    topo = parse_topology(_topology(tmp_path))
    transport.secure(security.keyring(topo, "head"))
    try:
        pull = transport.socket(zmq.PULL, bind="inproc://test-wake")
        push = transport.socket(zmq.PUSH, connect="inproc://test-wake")
        push.send(b"x")
        assert pull.poll(2000) and pull.recv() == b"x"
        for sock in (push, pull):
            sock.close(linger=0)
        with pytest.raises(security.SecurityError, match="not an endpoint of the topology"):
            transport.socket(zmq.PUSH, connect="tcp://127.0.0.1:1")  # a tcp peer still needs its key
    finally:
        transport.secure(None)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("http_processes", [1, 2])
def test_the_http_api_serves_with_security_on(tmp_path, tiny_model_dir, http_processes):
    import urllib.request
    from conftest import greedy_tokens
    data = _topology(tmp_path, tiny_model_dir)
    data["nodes"] = data["nodes"][:1]
    http_port = reserve_ports(1)[0]
    data["ingest"].update(http_port=http_port, http_processes=http_processes, model_name="tiny")
    data["detokenizer"]["output"] = "jsonl"
    data["workers"] = [{"name": "w1", "node": "head", "device": "cpu", "kv_port": data["workers"][0]["kv_port"]}]
    path = tmp_path / "secure-http.yaml"
    path.write_text(yaml.safe_dump(data))
    err = open(tmp_path / "head.err", "a+")
    node = warm.popen(["node", str(path), "--node", "head"],
                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    body = json.dumps({"model": "tiny", "prompt": [1, 5, 70, 300], "max_tokens": 4, "temperature": 0}).encode()
    try:
        deadline, answer = time.monotonic() + 120, None
        while answer is None and time.monotonic() < deadline:
            assert node.poll() is None, (err.seek(0), err.read()[-3000:])[1]
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    answer = json.loads(resp.read())
            except OSError:  # not listening yet, or 503 while no worker serves
                time.sleep(0.3)
        assert answer is not None, "no answer from the HTTP API"
        assert answer["usage"]["completion_tokens"] == 4
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        want = greedy_tokens(tiny_model_dir, [1, 5, 70, 300], 4)
        assert answer["choices"][0]["text"] == tok.decode([1, 5, 70, 300] + want)[len(tok.decode([1, 5, 70, 300])):]
    finally:
        stop_group(node)
        err.seek(0)
        log = err.read()
        err.close()
    assert "SecurityError" not in log and "refused" not in log, log[-3000:]


def test_a_workers_hello_cannot_choose_what_a_move_costs(tmp_path, tiny_model_dir):
    """A worker that says its KV is tiny and its model huge would make every move of its
    sequences a KV transfer (and ship whatever it likes). The router takes both numbers from
    the model the topology names."""
    from qmigrate.config import local_topology
    from qmigrate.hub.model_facts import migration_costs
    from qmigrate.router.loop import Router
    from qmigrate.router.records import choose_mechanism
    topo = local_topology(2, str(tiny_model_dir), str(tmp_path))
    router = Router(topo)
    lies = {"kv_bytes_per_token": 1, "num_params": 10 ** 15, "max_seqs": 8}
    rc = topo.router
    assert choose_mechanism(4000, 1, 10 ** 15, rc.link_gbps, rc.prefill_tflops) == "transfer"
    worker = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="w1-rogue")
    try:
        worker.send(codec.encode(P.Hello("worker", "w1", info=lies)))
        _pump(router, lambda: "w1" in router.sched.workers)
        state = router.sched.workers["w1"]
        costs = migration_costs(str(tiny_model_dir))
        assert (state.kv_bytes_per_token, state.num_params) == (costs.kv_bytes_per_token("float32"), costs.num_params)
        assert state.max_seqs == 8   # what is the worker's own to say still counts
        assert choose_mechanism(4000, state.kv_bytes_per_token, state.num_params, rc.link_gbps,
                                rc.prefill_tflops) == "recompute"
    finally:
        for sock in (worker, router.work, router.telemetry, router.out.detok):
            sock.close(linger=0)


def test_migration_costs_come_from_the_models_config(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    from qmigrate.hub.model_facts import migration_costs
    costs = migration_costs(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert costs.kv_bytes_per_token("bfloat16") == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    assert abs(costs.num_params - sum(p.numel() for p in model.parameters())) < 0.01 * costs.num_params
    assert migration_costs(str(tmp_path / "nowhere")) is None   # unknown here: every move recomputes
