"""Separate hosts: ingest and router, two workers and the detokenizer each in a network
namespace with its own address, talking tcp through a bridge. One worker's link is cut
mid-run; every request completes with generate()'s tokens. Needs root and `ip netns`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

import helpers as H

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODES = {"head": 1, "n1": 2, "n2": 3, "out": 4}  # node -> last byte of its address


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def _hosts():
    """(tag, hub): a namespace per node, bridged in a namespace of its own; all removed after."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = f"qm{os.getpid() % 100000}"
    hub = f"{tag}hub"
    made = []
    try:
        try:
            _ip("netns", "add", hub)
        except (subprocess.CalledProcessError, OSError) as exc:
            pytest.skip(f"`ip netns add` does not work here: {getattr(exc, 'stderr', b'') or exc}")
        made.append(hub)
        # The bridge lives in its own namespace: nothing of the machine's network is touched.
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for node, host in NODES.items():
            ns = f"{tag}{node}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", hub, "link", "add", f"v{node}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"v{node}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"10.213.0.{host}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield tag, hub
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


# Run in the head's namespace: polls the router until `n` workers have joined, at most `timeout` s.
_WORKERS_JOINED = """
import sys, time
from qmigrate.config import load_topology
from qmigrate.wire import protocol as P
from qmigrate.wire import transport
router = load_topology(sys.argv[1]).endpoint("router").connect
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        if transport.request(router, P.StatsRequest(), timeout_s=1.0, expect=P.Stats).counters.get("workers", 0) >= int(sys.argv[2]):
            print("joined")
            break
    except transport.Unreachable:
        pass
    time.sleep(0.2)
"""


def _cut_link(tmp_path, tiny_model_dir):
    """The run, with the hosts made for it and removed after: (what was printed, the router's
    counters, the prompts). Mostly waits (for the workers, the heartbeats): it runs in the
    background beside test_models' in-process tests (conftest's `early`)."""
    with _hosts() as (tag, hub):
        return _run_cut_link(tag, hub, tmp_path, tiny_model_dir)


def _run_cut_link(tag, hub, tmp_path, tiny_model_dir):
    # Links cut between hosts are the subject here; the keys of security have tests of their own.
    data = {"transport": "tcp", "model": {"path": str(tiny_model_dir)}, "security": {"enabled": "off"},
            "nodes": [{"name": n, "address": f"10.213.0.{h}", "bind": f"10.213.0.{h}"} for n, h in NODES.items()],
            "router": {"node": "head", "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5, "lease_timeout_s": 3.0},
            "ingest": {"node": "head", "input": "jsonl"},
            "detokenizer": {"node": "out", "output": "jsonl"},
            "workers": [{"name": "w1", "node": "n1", "max_num_seqs": 2}, {"name": "w2", "node": "n2", "max_num_seqs": 2}]}
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(data))
    prompts = H.prompts(31, "h", n=6, new_tokens=150)
    out = open(tmp_path / "out", "a+")
    err = open(tmp_path / "err", "a+")
    nodes = []

    def start(node: str, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, extra=()):
        proc = subprocess.Popen(["ip", "netns", "exec", f"{tag}{node}", sys.executable, "-m", "qmigrate",
                                 "node", str(path), "--node", node, *extra],
                                stdin=stdin, stdout=stdout, stderr=err, text=True, start_new_session=True)
        nodes.append(proc)
        return proc

    def printed() -> str:
        out.seek(0)
        return out.read()

    def stats() -> dict[str, str]:
        text = subprocess.run(["ip", "netns", "exec", f"{tag}head", sys.executable, "-m", "qmigrate", "stats",
                               str(path)], capture_output=True, text=True, timeout=60).stdout
        return dict(line.split() for line in text.splitlines() if len(line.split()) == 2)

    try:
        start("out", stdout=out)
        start("n1")
        start("n2")
        head = start("head", stdin=subprocess.PIPE, extra=["--stdin"])
        # Both workers in before the prompts: one that joins late would miss the whole run.
        # Asked of one process in the head's namespace, not of a new interpreter each time: those
        # would compete with the workers' own starts.
        poller = subprocess.Popen(["ip", "netns", "exec", f"{tag}head", sys.executable, "-c", _WORKERS_JOINED,
                                   str(path), "2", "120"], stdout=subprocess.PIPE, stderr=err, text=True,
                                  start_new_session=True)
        nodes.append(poller)
        joined, _ = poller.communicate(timeout=150)
        assert joined.strip() == "joined", f"w1 and w2 did not both join\n{open(tmp_path / 'err').read()[-2000:]}"
        head.stdin.write("".join(json.dumps(p) + "\n" for p in prompts))
        head.stdin.close()
        deadline = time.monotonic() + 180
        while printed().count('"delta"') < 6:
            assert time.monotonic() < deadline, "no output"
            time.sleep(0.1)
        assert printed().count('"done": true') < len(prompts), "the run ended before the cut"
        _ip("-n", hub, "link", "set", "vn2", "down")  # w2's host drops off the network
        while printed().count('"done": true') < len(prompts):
            assert time.monotonic() < deadline, f"unfinished after the cut\n{printed()[-1500:]}"
            time.sleep(0.2)
        counters = stats()
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in nodes:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return printed(), counters, prompts


@pytest.mark.early(scenario=_cut_link, beside="test_models.py")
def test_a_cut_link_between_hosts_loses_nothing(early_run, tiny_model_dir):
    from conftest import check_outputs
    printed, counters, prompts = early_run.result()
    assert int(counters.get("workers_lost", 0)) >= 1, counters
    check_outputs(printed, prompts, tiny_model_dir)
