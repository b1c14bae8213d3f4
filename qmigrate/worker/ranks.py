"""The ranks of a tensor-parallel worker (`tensor_parallel_size: N` in its topology section).

Rank 0 is the worker process the router knows. It starts ranks 1..N-1 as child processes,
which join it through torch.distributed with a file:// rendezvous in a private temporary
directory: on a GPU each is spawned (`python -m qmigrate.worker.ranks`: a CUDA context does
not survive a fork); on the CPU each is forked from rank 0 before it loads anything, its
imports (torch, transformers) already done. Rank 0 alone loads the checkpoint, on the CPU;
the followers build the model from its config without weights, and rank 0 sends each its
shard (engine/parallel/scatter.py). With load_format dummy no rank loads anything: each builds
the model without weights and makes its own shard on its device (engine/parallel/
dummy_shard.py). Every rank keeps its shard on its own device (rank r of a worker on cuda:K
uses cuda:K+r) and builds the same engine; then the followers do what rank 0 sends them
(engine/parallel/lockstep.py).

Failure: rank 0 polls its followers; when one exits, it says which and why, stops the
others and exits, so the router sees a dead worker and moves its sequences. A follower
dies with rank 0 (the parent-death signal, and its wait for rank 0's next command fails
once rank 0's connections close).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qmigrate.config import dump_topology, load_topology
from qmigrate.engine.parallel.sharding import TensorParallel
from qmigrate.hub.shape import ModelShape
from qmigrate.ops.process import before_sigterm, die_with, forget_sigterm
from qmigrate.worker.threads import share_cpu_threads

log = logging.getLogger("qmigrate.worker")

POLL_S = 0.5
STOP_WAIT_S = 10.0
EXIT_GRACE_S = 2.0   # a rank killed closes its sockets before its exit can be seen: how long to look


def rank_device(device: str, rank: int) -> str:
    """The device of rank `rank` of a worker whose topology device is `device`."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{int(device.partition(':')[2] or 0) + rank}"


def load_dtype(dtype: str, device: str) -> str:
    """The dtype to load the checkpoint in on the CPU: the one the device would run ("auto":
    bfloat16 on a GPU, float32 on the CPU)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def build_engine(topo, name: str, model_path: str, tp: TensorParallel):
    """This rank's engine, sharded onto tp.device: on rank 0 from the checkpoint loaded on the
    CPU, on the others from the model's config, their shards' values sent by rank 0; with
    load_format dummy every rank from the config, its shard's random weights made on its device."""
    from qmigrate.hub.loading import load_model, load_structure
    from qmigrate.engine.engine import Engine
    cfg = topo.worker(name)
    dtype, trust = load_dtype(topo.model.dtype, cfg.device), topo.model.trust_remote_code
    load_format = topo.model.load_format
    if tp.is_leader and load_format != "dummy":
        model, _ = load_model(model_path, "cpu", dtype, trust_remote_code=trust)
    else:
        model = load_structure(model_path, dtype, trust_remote_code=trust)
    return Engine(model, cfg.engine_config(), tp=tp, load_format=load_format)


def check_model(name: str, model_path: str, world: int, trust_remote_code: bool = False) -> None:
    """Before any rank starts: the model's heads and MLP widths must divide by the world size."""
    from transformers import AutoConfig
    from qmigrate.engine.parallel.sharding import LayoutError, check_layout
    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    try:
        check_layout(world, shape.num_heads, shape.num_kv_heads, shape.mlp_widths)
    except LayoutError as exc:
        raise SystemExit(f"worker {name}: {exc}") from None


class Ranks:
    """Rank 0's side: the followers it spawned, and the group they share."""

    def __init__(self, topo, name: str, model_path: str):
        cfg = topo.worker(name)
        self.name, self.world = name, cfg.tensor_parallel_size
        self.is_stopping = False
        self.procs: list[subprocess.Popen] = []
        self.dir: Path | None = None
        # A node that stops while this starts sends SIGTERM at any point: the clean-up is
        # registered before the directory exists (a worker stopped by its node leaves neither a
        # follower nor the directory behind), and this thread holds the signal until the
        # followers have started, so none starts with rank 0's clean-up as its own.
        before_sigterm(self._kill_all)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM,))
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"qm-tp-{name}-"))
            topo_path = self.dir / "topology.yaml"
            dump_topology(topo, topo_path)
            init = f"file://{self.dir}/rendezvous"
            parent = os.getpid()
            for rank in range(1, self.world):
                args = (str(topo_path), name, model_path, rank, init)
                if cfg.device.startswith("cuda"):
                    self.procs.append(subprocess.Popen([sys.executable, "-m", "qmigrate.worker.ranks", *map(str, args)],
                                                       preexec_fn=lambda: _follower_starts(parent, mask)))
                else:
                    self.procs.append(ForkedRank(args, parent, mask))
        except BaseException:
            self._kill_all()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)   # a SIGTERM that came runs _kill_all now
        try:
            self.watcher = threading.Thread(target=self._watch, name="tp-ranks", daemon=True)
            self.watcher.start()
            self.tp = TensorParallel.init(0, self.world, init, rank_device(cfg.device, 0))
        except BaseException:
            self.stop()
            raise

    def _watch(self) -> None:
        """A follower that exits takes the worker down: rank 0 may be waiting on it inside a
        collective that would never end, so this exits the process from here."""
        while not self.is_stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self.is_stopping:
                    print(f"worker {self.name}: tensor-parallel rank {rank} exited (code {code}); "
                          f"stopping the worker", file=sys.stderr, flush=True)
                    self._kill_all()
                    os._exit(1)
            threading.Event().wait(POLL_S)

    def stop(self, leader=None) -> None:
        """Leaving on purpose: tell the followers to stop (when they are following), then wait."""
        self.is_stopping = True
        if leader is not None:
            try:
                leader.stop()
            except RuntimeError as exc:   # a follower already gone
                log.warning("tensor-parallel stop: %s", exc)
        for proc in self.procs:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def failed(self, exc: Exception) -> SystemExit:
        """A collective failed (a peer's connection closed): the other ranks are stopped, and
        what the worker exits with says which rank went first, when one did. A rank that dies
        closes its connections before its exit shows, so its exit is waited for a moment."""
        self.is_stopping = True
        deadline = time.monotonic() + EXIT_GRACE_S
        while not (gone := self._exited()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._kill_all()
        if gone:
            rank, code = gone[0]
            return SystemExit(f"worker {self.name}: tensor-parallel rank {rank} exited (code {code}); "
                              f"stopping the worker")
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return SystemExit(f"worker {self.name}: a tensor-parallel collective failed: {reason}")

    def _exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of each follower that has exited."""
        return [(r, code) for r, p in enumerate(self.procs, start=1) if (code := p.poll()) is not None]

    def _kill_all(self) -> None:
        """Kill the followers, and remove the directory once they are gone: one still polling
        the rendezvous file would make it again inside a directory being removed."""
        self.is_stopping = True   # the followers' exits are this one's doing: the watcher says nothing
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(EXIT_GRACE_S)
            except subprocess.TimeoutExpired:   # stuck in the driver: the directory goes anyway
                pass
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


class ForkedRank:
    """A CPU follower forked from rank 0 (`follow` in the child), with what Ranks uses of
    subprocess.Popen: its exit code as Popen gives it, minus the signal that killed it."""

    def __init__(self, args: tuple, parent: int, mask):
        import multiprocessing
        self.proc = multiprocessing.get_context("fork").Process(
            target=_forked_follow, args=(parent, mask, *args), name=f"rank {args[3]} of {args[1]}", daemon=True)
        self.proc.start()
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.proc.name}", timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()


def _follower_starts(parent: int, mask) -> None:
    """In a follower before it runs anything of its own: rank 0's SIGTERM clean-up is rank 0's,
    the follower dies with rank 0, and the signals rank 0 held across the start come through."""
    forget_sigterm()
    die_with(parent)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _forked_follow(parent: int, mask, *args) -> None:
    _follower_starts(parent, mask)
    code = follow(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def follow(topo_path: str, name: str, model_path: str, rank: int, init_method: str) -> int:
    """A follower rank's whole life: join, build the same engine as rank 0, follow it."""
    from qmigrate.engine.parallel import lockstep
    from qmigrate.launch import set_title
    set_title("rank", f"{rank} of {name}")
    topo = load_topology(topo_path)
    cfg = topo.worker(name)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s worker {name} rank {rank}: %(message)s",
                        force=True)   # a forked rank's own, not rank 0's
    share_cpu_threads(topo, cfg)
    tp = TensorParallel.init(rank, cfg.tensor_parallel_size, init_method, rank_device(cfg.device, rank))
    engine = build_engine(topo, name, model_path, tp)
    lockstep.follow(engine)
    tp.close()
    if tp.device.type == "cuda":   # nothing left to do, and NCCL's teardown at exit can wait forever
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    topo_path, worker_name, path, rank_text, init = sys.argv[1:6]
    sys.exit(follow(topo_path, worker_name, path, int(rank_text), init))
