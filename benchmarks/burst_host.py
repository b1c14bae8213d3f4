"""The host's side of a burst of shared-prefix prompts, without a device: what the router spends
building the leases of a queue of them, and what a worker spends starting a lease of them
(a runner that returns zero logits in place of the model's forward, so only the bookkeeping
is timed).

Run: `python -m benchmarks.burst_host [--groups 64] [--per-group 16] [--system-len 1024]
[--question-len 128] [--lease-prompts 124]`. The worker side loads the tiny model (`--model`;
built where `qmigrate sim` builds it if missing), lets it take prompts of any length, and
starts `--repeats` leases of `--lease-prompts` prompts whose system prompts are cached; the
median is printed. The worker holds every prompt it started (as in a burst: nothing is
evicted), so its pool is sized for all of them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def router_leases(groups: int, per_group: int, system_len: int, question_len: int, max_tokens: int,
                  block_size: int = 16) -> tuple[float, list[tuple[float, int]]]:
    """The seconds the router takes to queue the prompts, and (seconds, new prompts) of each
    lease a caching worker gets until every prompt has started; the worker answers each with
    one token a row and every new prompt's blocks cached."""
    from qmigrate.config import RouterConfig
    from qmigrate.router.scheduler import Scheduler, WorkerState
    from qmigrate.wire import protocol as P
    from qmigrate.wire.prefix_keys import block_keys
    r = random.Random(1)
    specs = []
    for _ in range(groups):
        system = [r.randint(10, 31000) for _ in range(system_len)]
        for _ in range(per_group):
            ids = system + [r.randint(10, 31000) for _ in range(question_len)]
            specs.append(P.SeqSpec(len(specs) + 1, P.pack_i32(ids), len(ids), 256))
    s = Scheduler(RouterConfig(heartbeat_timeout_s=1e9))
    s.register(WorkerState("w", max_seqs=len(specs), max_tokens=max_tokens, block_size=block_size,
                           is_caching=True, kv_tokens=1 << 24), 0.0)
    t0 = time.perf_counter()
    s.admit(specs)
    admit_s = time.perf_counter() - t0
    out, num_new = [], 0
    for step in range(10 * len(specs)):
        t0 = time.perf_counter()
        grant = s.schedule("w", len(specs), max_tokens, float(step), None)
        dt = time.perf_counter() - t0
        if grant is None:
            break
        new = [row for row in grant.rows if row.spec is not None]
        out.append((dt, len(new)))
        s.cache_report("w", [k for row in new for k in block_keys(row.spec.token_ids, block_size)])
        n = len(grant.rows)
        s.complete(grant.lease_id, "w", [row.seq_id for row in grant.rows], [1] * n, [5] * n, [0] * n, float(step))
        num_new += len(new)
        if num_new >= len(specs):   # every prompt has started
            break
    return admit_s, out


class ZeroRunner:
    """A Runner (engine/runners/protocol.py) without a model: zero logits for every row."""

    name = "zero"
    can_feed = True   # a fed token is never read: nothing depends on the input ids

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def attach(self, pool, capture: bool = True) -> None:
        pass

    def forward(self, batch, feed=None):
        import torch
        return torch.zeros(batch.num_rows, self.vocab_size)

    def eager_sizes(self) -> list[int]:
        return []


def worker_starts(system_len: int, question_len: int, lease_prompts: int, repeats: int,
                  model_path: str | None = None) -> list[float]:
    """Seconds to start each lease of `lease_prompts` new prompts on systems already cached,
    on the model at model_path (a small one: its forward is not run; default the tiny model)."""
    import numpy as np
    from qmigrate.hub.loading import ensure_default_model, load_model
    from qmigrate.engine.engine import Engine
    from qmigrate.wire import protocol as P
    from qmigrate.worker.core import WorkerCore
    model, _ = load_model(model_path or ensure_default_model(), "cpu")
    length = system_len + question_len
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, length + 8)
    engine = Engine(model, use_runner=ZeroRunner(model.config.vocab_size),
                    max_kv_tokens=(repeats + 2) * lease_prompts * length, max_model_len=length + 8,
                    max_num_seqs=max(lease_prompts, 8), max_num_batched_tokens=lease_prompts * length)
    vocab = engine.shape.vocab_size
    core = WorkerCore(engine)
    rng = np.random.default_rng(0)
    systems = [[1] + rng.integers(10, vocab, system_len - 1).tolist() for _ in range(8)]
    next_id = iter(range(1, 1 << 30))

    def lease(lease_id: int, prompts: list[list[int]]) -> P.Lease:
        specs = [P.SeqSpec(next(next_id), P.pack_i32(p), len(p), 4) for p in prompts]
        return P.Lease(lease_id, lease_id, 10.0, P.pack_i64([s.seq_id for s in specs]),
                       P.pack_i32([len(p) for p in prompts]), P.pack_i32([p[-1] for p in prompts]), specs,
                       P.pack_i64([]), 1)

    def question() -> list[int]:
        return rng.integers(10, vocab, question_len).tolist()

    core.finish(core.start(lease(1, [system + question() for system in systems])))
    times = []
    for k in range(repeats + 2):   # two that warm up: the pool's first use of its blocks
        run_lease = lease(2 + k, [systems[i % len(systems)] + question() for i in range(lease_prompts)])
        t0 = time.perf_counter()
        run = core.start(run_lease)
        times.append(time.perf_counter() - t0)
        assert len(run.rows) == lease_prompts and min(run.cached.values()) >= system_len - 16, "no prefix hit"
        core.finish(run)
    return times[2:]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16384, help="The worker's new tokens a step.")
    ap.add_argument("--lease-prompts", type=int, default=124)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", help="Model directory for the worker side (default: the tiny model).")
    a = ap.parse_args(argv)
    admit_s, leases = router_leases(a.groups, a.per_group, a.system_len, a.question_len, a.max_tokens)
    ms = [f"{t * 1e3:.1f}" for t, _ in leases]
    print(f"router: {a.groups * a.per_group} prompts queued in {admit_s * 1e3:.1f} ms; {len(leases)} leases, "
          f"build ms {' '.join(ms)}")
    print(f"        first {leases[0][0] * 1e3:.1f} ms, later median "
          f"{statistics.median(t for t, _ in leases[1:]) * 1e3:.1f} ms; new prompts a lease "
          f"{' '.join(str(n) for _, n in leases)}")
    starts = worker_starts(a.system_len, a.question_len, a.lease_prompts, a.repeats, a.model)
    med = statistics.median(starts)
    print(f"worker: a lease of {a.lease_prompts} prompts of {a.system_len + a.question_len} ids "
          f"({a.system_len} cached) starts in {med * 1e3:.1f} ms (median of {len(starts)}), "
          f"{med / a.lease_prompts * 1e6:.0f} us a prompt")


if __name__ == "__main__":
    main()
