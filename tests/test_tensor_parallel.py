"""Tensor parallelism on the CPU (gloo): layouts, a sharded engine against one rank, sequences
moved both ways between world sizes (KV transferred or recomputed), and a migration from a
2-rank worker to a 1-rank worker in a fleet."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import check_outputs, reserve_ports, stop_group
import warm
from qmigrate.cli import app
from qmigrate.wire import protocol as P
from qmigrate.wire import transport
from qmigrate.wire.client import feed_lines

from qmigrate.engine.parallel import sharding as parallel
from qmigrate.engine.parallel.sharding import LayoutError, check_layout
from qmigrate.hub.shape import ModelShape

import families
import tp_ranks
import tp_spawn

# --- layouts -------------------------------------------------------------------------------


def test_kv_heads_split_or_replicated():
    four = check_layout(4, 8, 4, 64)
    assert [four.kv_heads(r) for r in range(4)] == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    two = check_layout(4, 8, 2, 64)    # fewer KV heads than ranks: each on two ranks
    assert [two.kv_heads(r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [two.kv_owner(h) for h in range(2)] == [0, 2]
    # every rank's query heads use only the KV heads it holds
    for layout in (four, two, check_layout(2, 8, 2, 64), check_layout(8, 8, 1, 64)):
        group = layout.num_heads // layout.num_kv_heads
        for r in range(layout.world):
            assert {h // group for h in layout.heads(r)} <= set(layout.kv_heads(r))


@pytest.mark.parametrize("world,heads,kv,inter,words", [
    (3, 4, 2, 64, "4 attention heads"), (4, 8, 6, 64, "6 KV heads"), (4, 8, 3, 64, "3 KV heads"),
    (2, 4, 2, 63, "MLP width of 63"), (4, 8, 2, (128, 64, 30), "MLP width of 30"), (0, 4, 2, 64, ">= 1")])
def test_a_layout_that_does_not_divide_says_what(world, heads, kv, inter, words):
    with pytest.raises(LayoutError, match=words):
        check_layout(world, heads, kv, inter)


def test_every_mlp_width_of_a_mixture_of_experts_is_checked():
    from transformers import MixtralConfig, Qwen2MoeConfig
    qwen = Qwen2MoeConfig(intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
    assert ModelShape.from_config(qwen).mlp_widths == (1408, 5632)
    assert ModelShape.from_config(MixtralConfig(intermediate_size=14336)).mlp_widths == (14336,)


def test_shards_put_back_together_are_the_weight():
    w = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    shards = [parallel.split_vocab(w, r, 2) for r in range(2)]
    assert all(s.shape == (4, 6) for s in shards)
    assert torch.equal(torch.cat(shards)[:7], w) and not shards[1][3].any()
    assert torch.equal(torch.cat([parallel.split_cols(w, r, 3) for r in range(3)], 1), w)
    fused = torch.arange(12.0)[:, None]   # parts of 8 and 4 rows
    halves = [parallel.split_parts(fused, [8, 4], parallel.even_ranges([8, 4], r, 2)) for r in range(2)]
    assert halves[0].flatten().tolist() == [0, 1, 2, 3, 8, 9]
    assert halves[1].flatten().tolist() == [4, 5, 6, 7, 10, 11]


@pytest.mark.parametrize("name", families.FAMILY_NAMES)
def test_a_model_without_weights_cuts_into_the_shapes_rank_0_sends(name):
    """A follower's shard of the model built on the meta device lists the tensors, in order
    and shape, of the shard that rank 0 cuts for it from the checkpoint; the rotary tables
    the layers share are listed once, and cutting leaves the model as it was."""
    from qmigrate.engine import models
    from qmigrate.engine.parallel import scatter
    from qmigrate.hub.loading import model_structure
    real = models.build(families.build_family_model(name))
    meta = models.build(model_structure(families.family_config(name)))
    before = [t.clone() for t in scatter.shard_tensors(real)]
    for world in (2, 4):
        for rank in range(world):
            cut = parallel.shard_model(real, parallel.TensorParallel(rank, world, "cpu"))
            empty = parallel.shard_model(meta, parallel.TensorParallel(rank, world, "cpu"), fill=False)
            listed = scatter.shard_tensors(empty)
            assert torch.equal(scatter.manifest(scatter.shard_tensors(cut)), scatter.manifest(listed))
            assert not any(t.is_meta for t in listed)
            tables = lambda m: {id(layer.attn.cos) for layer in m.layers}   # noqa: E731
            assert len(tables(empty)) == len(tables(meta)) == (2 if name == "gemma3" else 1)
    assert all(torch.equal(a, b) for a, b in zip(before, scatter.shard_tensors(real), strict=True))


def test_a_shard_list_that_differs_is_found_where_it_first_does():
    from qmigrate.engine.parallel import scatter
    a = scatter.manifest([torch.zeros(4, 8), torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16)])
    assert scatter.first_difference(a, a) == -1
    b = scatter.manifest([torch.zeros(4, 8), torch.zeros(3), torch.zeros(2, 2)])
    assert scatter.first_difference(a, b) == 2
    assert scatter.first_difference(a, a[:2]) == 2 and scatter.first_difference(a[:1], a) == 1
    err = scatter.mismatch(3, 2, 3, 3, a[2], b[2])
    assert "tensor 2 is bfloat16 [2, 2] from rank 0, float32 [2, 2] on rank 3" in str(err)


# --- settings -------------------------------------------------------------------------------


def test_serve_makes_workers_of_n_gpus_each():
    from qmigrate.config import ConfigError
    from qmigrate.serve import ServeOptions, serve_topology
    topo = serve_topology(ServeOptions(tensor_parallel_size=2), num_gpus=4)
    assert [(w.name, w.device, w.tensor_parallel_size) for w in topo.workers] == [("gpu0", "cuda:0", 2),
                                                                            ("gpu2", "cuda:2", 2)]
    assert [w.tensor_parallel_size for w in serve_topology(ServeOptions(), num_gpus=4).workers] == [1] * 4
    with pytest.raises(ConfigError, match="3 does not divide the 4 visible GPUs"):
        serve_topology(ServeOptions(tensor_parallel_size=3), num_gpus=4)


def test_a_worker_of_n_gpus_may_not_share_them():
    from qmigrate.config import ConfigError, parse_topology
    data = {"nodes": [{"name": "n"}], "router": {"node": "n"}, "ingest": {"node": "n"},
            "detokenizer": {"node": "n"},
            "workers": [{"name": "a", "node": "n", "device": "cuda:0", "tensor_parallel_size": 2},
                        {"name": "b", "node": "n", "device": "cuda:2"}]}
    assert parse_topology(data).worker("a").tensor_parallel_size == 2
    data["workers"][1]["device"] = "cuda:1"
    with pytest.raises(ConfigError, match="cuda:1 on node 'n' is also used by worker 'a'"):
        parse_topology(data)
    data["workers"][0]["tensor_parallel_size"] = 0
    with pytest.raises(ConfigError, match="tensor_parallel"):
        parse_topology(data)


# --- a sharded engine, ranks in processes --------------------------------------------------


def start_world(world: int, tiny_dir, tmp_path, device: str = "cpu", weightless_dir=None, interpreted: bool = True):
    """The ranks of a world (tp_ranks.run_world), started; finish_world waits for them.
    `interpreted` False: a CPU world without Triton's interpreter (tp_spawn.run_world_compiled)."""
    ctx = mp.get_context("spawn")
    out = tmp_path / f"world{world}.json"
    init = f"file://{tmp_path}/rendezvous{world}"
    extra = () if weightless_dir is None else (str(weightless_dir),)
    if device == "cpu":   # one process that forks the ranks (tp_ranks.run_world)
        target = tp_ranks.run_world if interpreted else tp_spawn.run_world_compiled
        procs = [ctx.Process(target=target, args=(world, init, str(tiny_dir), str(out), device, *extra))]
    else:   # CUDA and NCCL in forked children are not safe: a GPU world's ranks start as workers' do
        procs = [ctx.Process(target=tp_ranks.run_rank, args=(r, world, init, str(tiny_dir), str(out), device, *extra),
                             daemon=True)
                 for r in range(world)]
    try:
        for p in procs:
            p.start()
    except BaseException:
        stop_world((world, procs, out, tmp_path))
        raise
    return world, procs, out, tmp_path


def stop_world(started) -> None:
    for p in started[1]:
        if p.is_alive():
            p.kill()
            p.join()


def finish_world(started) -> dict:
    """What rank 0 found, and under "followers" what any other rank reported."""
    world, procs, out, tmp_path = started
    try:
        for p in procs:
            p.join(timeout=240)
    finally:
        stop_world(started)
    result = json.loads(out.read_text())
    followers = {r: json.loads(f.read_text()) for r in range(1, world)
                 if (f := tmp_path / f"world{world}.json.rank{r}").exists()}
    errors = [r["error"] for r in (result, *followers.values()) if "error" in r]
    assert not errors, errors
    if followers:
        result["followers"] = followers
    return result


def run_world(world: int, tiny_dir, tmp_path, device: str = "cpu", weightless_dir=None) -> dict:
    """What rank 0 found (tp_ranks.run_rank), and under "followers" what any other rank reported."""
    return finish_world(start_world(world, tiny_dir, tmp_path, device, weightless_dir))


def _weightless_copy(model_dir, tmp_path):
    """The model's directory without its weight files: config and tokenizer only."""
    weights = {".safetensors", ".bin", ".pt"}
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for f in model_dir.iterdir():
        if f.suffix not in weights:
            shutil.copy(f, weightless)
    assert {f.suffix for f in model_dir.iterdir()} & weights
    return weightless


def _cpu_worlds(tmp_path, tiny_model_dir) -> dict:
    """The 2-rank and the 4-rank world of the test below, run together beside in-process tests
    (conftest's `early` lane): each is mostly one rank at work while the others wait for it,
    so the two share the machine's cores with the test process. The 4-rank world runs without
    the Triton interpreter. Returns each world's result, or what finishing it raised."""
    worlds = {4: start_world(4, tiny_model_dir, tmp_path, interpreted=False)}
    try:
        worlds[2] = start_world(2, tiny_model_dir, tmp_path, weightless_dir=_weightless_copy(tiny_model_dir, tmp_path))
        results = {}
        for world, started in worlds.items():
            try:
                results[world] = finish_world(started)
            except Exception as exc:   # the other world's test still gets its result
                results[world] = exc
        return results
    finally:
        for started in worlds.values():
            stop_world(started)


@pytest.mark.timeout(300)
@pytest.mark.early(scenario=_cpu_worlds, beside="test_fp8.py")   # in-process tests on one core
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_engine_matches_one_rank_and_generate(world, early_run):
    """2 ranks run the Triton kernels where the CPU has the interpreter (a rank's share of the
    heads, the experts' thinner matrices); 4 ranks, the torch reference path: the same layouts
    with KV heads replicated, at a fraction of the interpreter's time.

    At 2 ranks rank 1 also builds every model as a follower does in a worker: from its config
    alone, its tensors on the meta device (the tiny model's from a directory without its
    weight files), and may not load a checkpoint, so its shard all comes from rank 0. Ranks
    that built different models stop at startup, both naming the first tensor that differs,
    rather than filling wrong shapes or waiting."""
    kernels = world == 2 and os.environ.get("TRITON_INTERPRET") == "1"
    result = early_run.result()[world]
    if isinstance(result, Exception):
        raise result
    if world == 2:
        mismatch, followers = result.pop("mismatch"), result.pop("followers")
        said = ("tensor-parallel startup: rank 0 sends rank 1 a shard of 21 tensors, rank 1 expects 21; "
                "tensor 8 is float32 [96, 64] from rank 0, float32 [64, 64] on rank 1 (the ranks built different models)")
        assert mismatch == followers[1]["mismatch"] == said
    assert set(result) == {"tiny", *tp_ranks.FAMILIES, *tp_ranks.SHARED_FAMILIES}
    assert {n for n, case in result.items() if case["kernels"]} == (set(result) if kernels else set())
    for name, case in result.items():
        assert case["steps"] == tp_ranks.NUM_NEW, name
        # fp32 sums in another order (row-parallel partial sums): within 1e-5 of the logits' scale
        assert case["max_logit_diff"] <= 1e-5 * max(1.0, case["logit_scale"]), (name, case)
        assert case["got"] == case["ref"] == case["expected"], name
        moved = case["moved"]
        assert moved["kv_diff"] <= 1e-5 * max(1.0, moved["kv_scale"]), name   # gathered: the one-rank KV
        assert moved["to_one"] == moved["to_ranks"] == case["moved_expected"], name
        assert moved["recomputed_to_one"] == moved["recomputed_to_ranks"] == case["moved_expected"][:1], name


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_over_nccl_match_one_gpu(tiny_model_dir, tmp_path):
    """fp32 on the GPU: the ranks' sums run in another order, and a near-tie could flip, so
    the tokens are compared with one GPU's and the logits within the same relative bound.
    A dense and a MoE family beside the tiny model (tp_ranks.GPU_CASES): the CPU worlds cover
    the rest of the layouts."""
    result = run_world(2, tiny_model_dir, tmp_path, device="cuda")
    assert set(result) == set(tp_ranks.GPU_CASES)
    for name, case in result.items():
        assert case["max_logit_diff"] <= 1e-4 * max(1.0, case["logit_scale"]), (name, case)
        assert case["got"] == case["ref"], name
        assert case["moved"]["to_one"] == case["moved"]["to_ranks"], name
        assert case["moved"]["recomputed_to_one"] == case["moved"]["recomputed_to_ranks"], name


class _Follower:
    """A follower's process as rank 0 sees it: it shows its exit from the `after`-th look on
    (a rank killed closes its connections before its exit can be seen)."""

    def __init__(self, after: int, code: int = -9):
        self.looks, self.after, self.code = 0, after, code

    def poll(self):
        self.looks += 1
        return self.code if self.looks > self.after else None

    def kill(self):
        self.after = 0

    def wait(self, timeout=None):
        if (code := self.poll()) is None:
            raise subprocess.TimeoutExpired("rank 1", timeout)
        return code


def test_a_failed_collective_names_the_rank_that_died_though_its_exit_shows_later(monkeypatch, tmp_path):
    from qmigrate.worker import ranks
    r = object.__new__(ranks.Ranks)
    r.name, r.dir, r.is_stopping = "w1", tmp_path / "ranks", False
    r.procs = [_Follower(after=3)]
    said = str(r.failed(RuntimeError("Connection closed by peer [127.0.0.1]:1234")))
    assert said == "worker w1: tensor-parallel rank 1 exited (code -9); stopping the worker"
    assert r.is_stopping
    # no rank exits: the collective's own error, once the grace is over
    monkeypatch.setattr(ranks, "EXIT_GRACE_S", 0.2)
    r.procs = [_Follower(after=10**9)]
    said = str(r.failed(RuntimeError("Connection closed by peer [127.0.0.1]:1234\nsecond line")))
    assert said == "worker w1: a tensor-parallel collective failed: Connection closed by peer [127.0.0.1]:1234"


def test_a_forked_cpu_rank_shows_its_end_as_a_spawned_one_does(tmp_path, tiny_model_dir):
    """Rank 0 forks a CPU worker's followers (ranks.ForkedRank): a follower that fails exits 1
    (its traceback on stderr), one that waits for rank 0 is running until killed, and a
    killed one's code is minus the signal, as subprocess gives it for a spawned rank."""
    from qmigrate.worker import ranks
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump({
        "transport": "ipc", "ipc_dir": str(tmp_path / "ipc"), "model": {"path": str(tiny_model_dir)},
        "nodes": [{"name": "n"}], "router": {"node": "n"}, "ingest": {"node": "n"}, "detokenizer": {"node": "n"},
        "workers": [{"name": "w1", "node": "n", "device": "cpu", "tensor_parallel_size": 2}]}))
    init = f"file://{tmp_path}/rendezvous"
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())   # this process's, for the followers to restore
    failed = ranks.ForkedRank((str(tmp_path / "missing.yaml"), "w1", str(tiny_model_dir), 1, init), os.getpid(), mask)
    assert failed.wait(120) == 1
    waiting = ranks.ForkedRank((str(topo), "w1", str(tiny_model_dir), 1, init), os.getpid(), mask)
    try:
        deadline = time.monotonic() + 60
        while not _title(waiting.pid).startswith("qmigrate rank 1 of w1"):   # then it waits for rank 0
            assert time.monotonic() < deadline and waiting.poll() is None, _title(waiting.pid)
            time.sleep(0.05)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(0.2)
        assert waiting.poll() is None
    finally:
        waiting.kill()
    assert waiting.wait(30) == -signal.SIGKILL


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --- a 2-rank worker in a fleet: real role processes --------------------------------------------


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    with _fleet_of(tmp_path, tiny_model_dir) as start:
        yield start


@contextlib.contextmanager
def _fleet_of(tmp_path, tiny_model_dir):
    """start(migration, prompts): a node running every role, w1 over 2 ranks and w2 on one;
    once both workers have joined, the prompts are fed to it. stats() reads the router's counters."""
    procs = []

    def start(migration: str, prompts: list[dict]):
        ports = reserve_ports(7)
        data = {
            "transport": "tcp", "model": {"path": str(tiny_model_dir)},
            "nodes": [{"name": "head", "address": "127.0.0.1", "bind": "127.0.0.1"}],
            "router": {"node": "head", "port": ports[0], "telemetry_port": ports[1], "migration": migration,
                       "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0, "lease_timeout_s": 5.0,
                       "max_lease_steps": 1},
            "ingest": {"node": "head", "port": ports[2], "reply_port": ports[6], "input": "jsonl"},
            "detokenizer": {"node": "head", "port": ports[3], "output": "jsonl"},
            "workers": [{"name": "w1", "node": "head", "device": "cpu", "kv_port": ports[4], "max_num_seqs": 4,
                         "tensor_parallel_size": 2, "max_kv_tokens": 2048},
                        {"name": "w2", "node": "head", "device": "cpu", "kv_port": ports[5], "max_num_seqs": 4,
                         "max_kv_tokens": 2048}],
        }
        path = tmp_path / f"fleet-{migration}.yaml"
        path.write_text(yaml.safe_dump(data))
        out, err = open(tmp_path / "head.out", "a+"), open(tmp_path / "head.err", "a+")
        tmp = tmp_path / "node-tmp"   # the temp directory of the node's processes
        tmp.mkdir(exist_ok=True)
        proc = warm.popen(["node", str(path), "--node", "head"],
                          stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, start_new_session=True,
                          env={**os.environ, "TMPDIR": str(tmp)})
        proc.out, proc.err, proc.tmp = out, err, tmp
        procs.append(proc)
        router = f"tcp://127.0.0.1:{ports[0]}"
        stats = lambda: _stats(router)  # noqa: E731
        _wait_for("both workers", lambda s: s.get("workers") == 2, stats)
        # fed from this process: a new interpreter starts too slowly, and the tiny model could
        # finish every request before the test looks
        lines = io.StringIO("".join(json.dumps(p) + "\n" for p in prompts))
        threading.Thread(target=feed_lines, args=(f"tcp://127.0.0.1:{ports[2]}", lines, 30.0), daemon=True).start()
        return path, proc, stats

    try:
        yield start
    finally:
        for proc in procs:
            stop_group(proc)


def _stats(router: str) -> dict:
    try:
        return transport.request(router, P.StatsRequest(), timeout_s=1.0, expect=P.Stats).counters
    except transport.Unreachable:
        return {}


def _wait_for(what: str, predicate, stats, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stats()
        if s and predicate(s):
            return s
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}; last stats {stats()}")


def _prompts(n: int = 6, new_tokens: int = 150) -> list[dict]:
    r = random.Random(8)
    return [{"id": f"p{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(2, 20))],
             "max_new_tokens": new_tokens} for i in range(n)]


def _output(proc, num_requests: int, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.out.seek(0)
        text = proc.out.read()
        if text.count('"done": true') >= num_requests:
            return text
        time.sleep(0.2)
    proc.err.seek(0)
    pytest.fail(f"only {text.count(chr(34) + 'done' + chr(34) + ': true')} of {num_requests} finished: "
                f"{proc.err.read()[-3000:]}")


def _follower_of(proc) -> int | None:
    """The pid of rank 1 of w1, among the node's processes (its own session)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                session = int(f.read().rsplit(")", 1)[1].split()[3])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if session == proc.pid and (b"qmigrate.worker.ranks" in cmd or cmd.startswith(b"qmigrate rank 1 of w1")):
            return int(entry)
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("migration", ["recompute", "transfer"])
def test_a_drained_two_rank_worker_moves_its_sequences_to_a_one_rank_worker(migration, fleet, tiny_model_dir):
    """Sequences leave the 2-rank w1 for the 1-rank w2 by the mechanism the router is told to
    use; every output is generate()'s; w1 and its second rank exit."""
    prompts = _prompts()
    path, proc, stats = fleet(migration, prompts)
    _wait_for("w1 to hold unfinished sequences", lambda s: s.get("owned_w1", 0) >= 1 and s.get("live", 0) >= 2, stats)
    drain = CliRunner().invoke(app, ["drain", str(path), "--worker", "w1"])
    assert drain.exit_code == 0 and "draining w1" in drain.output, drain.output
    out = _output(proc, len(prompts))
    s = stats()
    assert s.get("migrations_drain", 0) > 0 and s.get(f"migrations_by_{migration}", 0) > 0, s
    check_outputs(out, prompts, tiny_model_dir)
    deadline = time.monotonic() + 30
    while _follower_of(proc) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _follower_of(proc) is None, "the drained worker's second rank did not exit"


def _rank_dies(tmp_path, tiny_model_dir) -> None:
    """The test below, run beside in-process tests (conftest's `early` lane)."""
    with _fleet_of(tmp_path, tiny_model_dir) as fleet:
        _a_rank_dies(fleet, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.early(scenario=_rank_dies, beside="test_prefix_cache.py")   # in-process tests on one core
def test_a_rank_that_dies_takes_its_worker_down_and_nothing_is_lost(early_run):
    early_run.result()   # raises what the scenario's checks raised


def _a_rank_dies(fleet, tiny_model_dir) -> None:
    prompts = _prompts()
    _, proc, stats = fleet("auto", prompts)
    _wait_for("w1 to hold unfinished sequences", lambda s: s.get("owned_w1", 0) >= 1 and s.get("live", 0) >= 2, stats)
    rank1 = _follower_of(proc)
    assert rank1 is not None
    assert _title(rank1).startswith("qmigrate rank 1 of w1"), _title(rank1)   # a child of w1 itself
    with open(f"/proc/{rank1}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    assert _title(parent).startswith("qmigrate worker w1"), _title(parent)
    os.kill(rank1, signal.SIGKILL)
    out = _output(proc, len(prompts))
    # w1 died and its sequences moved on as a dead worker's (the node may have started w1 again
    # since, before the router saw it silent: its counters, not the fleet's size)
    _wait_for("w1's sequences to move as a dead worker's", lambda s: s.get("migrations_dead", 0) > 0, stats)
    check_outputs(out, prompts, tiny_model_dir)
    proc.err.seek(0)
    assert "tensor-parallel rank 1 exited" in proc.err.read()
    # w1 was started again, over two ranks: stopped with its node, it leaves neither a rank
    # nor the ranks' directory behind
    deadline = time.monotonic() + 60
    while not list(proc.tmp.glob("qm-tp-w1-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(proc.tmp.glob("qm-tp-w1-*")), "w1 was not started again over two ranks"
    stop_group(proc)
    assert not list(proc.tmp.glob("qm-tp-*"))
