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

HOG = """
import sys, time, torch
free, total = torch.cuda.mem_get_info(0)
keep = int(sys.argv[1])
held = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda:0")
print(f"held {held.numel() / 2**30:.2f} GiB of {total / 2**30:.1f} GiB", flush=True)
time.sleep(600)
"""


def test_a_process_grabbing_gpu_memory_makes_the_worker_shed_work(tmp_path, tiny_model_dir):
    from qmigrate.config import load_topology
    from qmigrate.status import fetch
    from qmigrate.transport import Unreachable
    two = torch.cuda.device_count() >= 2
    workers = [{"name": "w1", "node": "local", "device": "cuda:0", "gpu_memory_utilization": 0.4 if two else 0.2},
               {"name": "w2", "node": "local", "device": "cuda:1" if two else "cuda:0",
                "gpu_memory_utilization": 0.4 if two else 0.2}]
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
                "max_new_tokens": 400} for i in range(64)]
    node = subprocess.Popen([sys.executable, "-m", "qmigrate", "node", str(path), "--node", "local", "--stdin"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    hog = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if fetch(router, 1.0)["router"].get("workers") == 2:
                    break
            except Unreachable:
                pass
            assert node.poll() is None, node.stderr.read()[-3000:]
            time.sleep(0.2)
        node.stdin.write("".join(json.dumps(p) + "\n" for p in prompts))
        node.stdin.flush()
        while not any(w["name"] == "w1" and w["tokens_total"] > 0 for w in fetch(router, 5.0)["workers"]):
            time.sleep(0.05)
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(256 << 20)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
        print(hog.stdout.readline().strip())
        time.sleep(2.0)  # a few monitor reports
        snap = fetch(router, 5.0)
        w1 = next(w for w in snap["workers"] if w["name"] == "w1")
        print("w1 while the memory is held:", w1)
        assert w1["state"] == "memory-short", w1
        out, err = node.communicate(timeout=400)
    finally:
        if hog is not None:
            stop_group(hog)
        stop_group(node)
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
