"""On a GPU: another process grabs most of a GPU's free memory mid-run. The worker on that
GPU must shed work (no new prefills, its sequences migrate off with cause "memory") with no
out-of-memory error, and every request completes. Skips cleanly without CUDA.

Run: python -m pytest -q -m gpu tests/test_gpu_memory.py -s
(two GPUs show the migration; on one GPU both workers share it, so only admission stops.)
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import stop_group

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Starts CUDA first and grabs the memory only when told (a line on stdin): importing torch and
# starting CUDA take seconds, longer than a fast GPU takes to finish the whole run.
HOG = """
import sys, time, torch
torch.cuda.init()
torch.cuda.mem_get_info(0)
print("ready", flush=True)
sys.stdin.readline()
free, total = torch.cuda.mem_get_info(0)
keep = int(sys.argv[1])
held = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda:0")
print(f"held {held.numel() / 2**30:.2f} GiB of {total / 2**30:.1f} GiB", flush=True)
sys.stdin.read()  # held until the test closes the pipe, or is gone
"""


def test_a_process_grabbing_gpu_memory_makes_the_worker_shed_work(tmp_path, tiny_model_dir):
    from qmigrate.config import load_topology
    from qmigrate.ops.status import fetch
    from qmigrate.wire.transport import Unreachable
    two = torch.cuda.device_count() >= 2
    # Few sequences a step, so that the run lasts many steps after the memory is taken: on an
    # H200 the 64 requests of 400 tokens were done before a grabbing process had started CUDA.
    workers = [{"name": "w1", "node": "local", "device": "cuda:0", "gpu_memory_utilization": 0.4 if two else 0.2,
                "max_seqs": 8},
               {"name": "w2", "node": "local", "device": "cuda:1" if two else "cuda:0",
                "gpu_memory_utilization": 0.4 if two else 0.2, "max_seqs": 8}]
    topo = {"transport": "ipc", "ipc_dir": str(tmp_path / "ipc"), "model": {"path": str(tiny_model_dir)},
            "nodes": [{"name": "local", "monitor": True}], "monitor": {"interval_s": 0.2},
            "router": {"node": "local", "migrate_on_load": False},
            "ingest": {"node": "local", "input": "jsonl"}, "detokenizer": {"node": "local", "output": "jsonl"},
            "workers": workers}
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(topo))
    router = load_topology(path).endpoint("router").connect
    r = random.Random(5)
    prompts = [{"id": f"p{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(4, 60))],
                "max_new_tokens": 400, "ignore_eos": True} for i in range(64)]
    out_path, err_path = tmp_path / "node.out", tmp_path / "node.err"
    with open(out_path, "a+") as out_f, open(err_path, "a+") as err_f:
        # Files, not pipes: nothing is read until the end, and a full pipe would stop the node.
        node = subprocess.Popen([sys.executable, "-m", "qmigrate", "node", str(path), "--node", "local", "--stdin"],
                                stdin=subprocess.PIPE, stdout=out_f, stderr=err_f, text=True,
                                start_new_session=True)
    hog = None

    def wait_for(what: str, done, timeout_s: float) -> None:
        print(f"waiting for {what}", flush=True)
        deadline = time.monotonic() + timeout_s
        while not done():
            assert node.poll() is None, f"the node exited while waiting for {what}: {err_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout_s:g} s: {err_path.read_text()[-3000:]}"
            time.sleep(0.2)

    def snapshot() -> dict:
        try:
            return fetch(router, 2.0)
        except Unreachable:
            return {"router": {}, "workers": []}

    try:
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(256 << 20)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert hog.stdout.readline().strip() == "ready"
        wait_for("both workers", lambda: snapshot()["router"].get("workers") == 2, 300)
        node.stdin.write("".join(json.dumps(p) + "\n" for p in prompts))
        node.stdin.flush()
        wait_for("w1's first tokens",
                 lambda: any(w["name"] == "w1" and w["tokens_total"] > 0 for w in snapshot()["workers"]), 120)
        hog.stdin.write("grab\n")
        hog.stdin.flush()
        print(hog.stdout.readline().strip(), flush=True)
        finished = snapshot()["router"].get("finished", 0)
        assert finished < len(prompts) // 2, f"{finished} requests done before the memory was taken"
        time.sleep(2.0)  # a few monitor reports
        w1 = next(w for w in snapshot()["workers"] if w["name"] == "w1")
        print("w1 while the memory is held:", w1, flush=True)
        assert w1["state"] == "memory-short", w1
        if not two:
            # both workers share the GPU: none takes new prefills while the memory is held,
            # so the prompts still queued wait for it to come back
            stop_group(hog)
            hog = None
        node.stdin.close()
        node.wait(timeout=400)
    finally:
        if hog is not None:
            stop_group(hog)
        stop_group(node)
    out, err = out_path.read_text(), err_path.read_text()
    assert node.returncode == 0, err[-3000:]
    assert "out of memory" not in err.lower() and "Traceback" not in err, err[-3000:]
    finals = {rec["id"]: rec for rec in map(json.loads, out.splitlines()) if rec.get("done")}
    assert sorted(finals) == sorted(p["id"] for p in prompts)
    for p in prompts:
        rec = finals[p["id"]]
        assert "error" not in rec and 0 < len(rec["token_ids"]) <= p["max_new_tokens"], rec
    summary = re.search(r"migrations: (.*)", err)
    print(summary and summary.group(0))
    if two:
        assert summary and re.search(r"memory \d+", summary.group(1)), err[-2000:]
