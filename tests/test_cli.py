"""Errors users will hit get one clear line, never a traceback or a hang."""

from __future__ import annotations

import socket

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_topology(tmp_path) -> str:
    port = _unused_port()
    data = {"nodes": [{"name": "head", "address": "127.0.0.1"}], "router": {"node": "head", "port": port},
            "ingest": {"node": "head", "port": _unused_port()},
            "detokenizer": {"node": "head", "port": _unused_port()},
            "workers": [{"name": "w1", "node": "head"}]}
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_unreadable_topology(tmp_path, qmigrate):
    missing = qmigrate("sim", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr and "Traceback" not in missing.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [\n")
    broken = qmigrate("sim", str(bad))
    assert broken.returncode == 2 and "bad.yaml" in broken.stderr and "Traceback" not in broken.stderr
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"nodes": [{"name": "a"}], "router": {"node": "a"},
                                     "ingest": {"node": "a"}, "detokenizer": {"node": "a"},
                                     "workers": [{"name": "w1", "node": "a", "device": "gpu"}]}))
    field = qmigrate("node", str(wrong), "--node", "a")
    assert field.returncode == 2 and "workers[0].device" in field.stderr, field.stderr


def test_model_directory_that_does_not_exist(tmp_path, qmigrate):
    run = qmigrate("sim", "--model", str(tmp_path / "no-such-model"), stdin="Hello\n")
    assert run.returncode == 2
    assert f"model directory not found: {tmp_path / 'no-such-model'}" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_role_that_cannot_load_its_model_says_why_in_one_line(tmp_path, qmigrate):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no_such_family", "architectures": ["NoSuch"]}')
    (model / "model.safetensors").write_bytes(b"")   # weights of a sort: loading itself must fail
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump({"transport": "ipc", "ipc_dir": str(tmp_path), "model": {"path": str(model)},
                                    "nodes": [{"name": "local"}], "router": {"node": "local"},
                                    "ingest": {"node": "local"}, "detokenizer": {"node": "local"},
                                    "workers": [{"name": "w1", "node": "local"}]}))
    run = qmigrate("role", "worker", "w1", "--config", str(topo))
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"qmigrate worker w1: cannot load model {model}" in run.stderr
    assert "Traceback" not in run.stderr


def test_unreachable_router_names_the_address(tmp_path, qmigrate):
    path = _loopback_topology(tmp_path)
    port = yaml.safe_load(open(path))["router"]["port"]
    # nothing listens there, so any timeout ends the same way: a short one keeps the test quick
    for args in (["drain", path, "--worker", "w1", "--timeout", "0.2"], ["stats", path, "--timeout", "0.2"]):
        run = qmigrate(*args)
        assert run.returncode == 1
        assert f"router unreachable at tcp://127.0.0.1:{port}" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
    feed = qmigrate("feed", path, "--timeout", "0.2", stdin="Hello\n")
    assert feed.returncode == 1 and "ingest unreachable at tcp://127.0.0.1:" in feed.stderr


def test_version(qmigrate):
    from qmigrate import __version__
    run = qmigrate("--version")
    assert (run.returncode, run.stdout) == (0, f"qmigrate {__version__}\n"), run.stderr


@pytest.mark.parametrize("args", [[], ["serve"], ["sim"], ["node"], ["feed"], ["drain"], ["stats"], ["bench"],
                                  ["bench", "curve"], ["bench", "decode-step"], ["bench", "admission-step"],
                                  ["model"], ["model", "tiny"], ["model", "bench"], ["model", "smollm2"]])
def test_help_at_every_level(qmigrate, args):
    run = qmigrate(*args, "--help")
    assert run.returncode == 0 and "Usage:" in run.stdout and len(run.stdout) > 200, run.stdout
    if args == ["model"]:
        assert all(name in run.stdout for name in ("tiny", "bench", "smollm2")), run.stdout
