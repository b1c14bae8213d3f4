"""The compute core on the CPU in fp32: batched steps, the KV store, sampling and WorkerCore.

Greedy output must equal `generate()` for each prompt alone, whatever the batch, and however
a sequence moved (KV transfer or recompute); seeded sampling must not depend on the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.engine.batch import StepBatch
from qmigrate.hub.builders import build_tiny_model
from qmigrate.hub.loading import load_model
from qmigrate.engine.rows import REFUSED, StepRow
from qmigrate.engine.engine import Engine
from qmigrate.engine.sampling import SamplingRows, sample, uniforms
from qmigrate.wire.protocol import Finish
from qmigrate.worker.core import MAX_TRANSFERS, WorkerCore

TEXTS = [
    "The old sailor carried a broken umbrella",
    "Hello",
    "我们明天早上八点在火车站见面",
    "def f(x, n=3):\n    return [x * i for i in range(n)]",
    "the committee measured seven blue bottles slowly, and then the river forgot a lost key "
    "because the night train whispered to the orchestra",
]
REF_LEN = 24  # greedy reference tokens computed per prompt


# --- fixtures ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("engine-model") / "tiny")
    return load_model(path, "cpu")


@pytest.fixture(scope="session")
def model(tiny):
    return tiny[0]


@pytest.fixture(scope="session")
def prompts(tiny) -> list[list[int]]:
    """Prompts of many lengths: text, BOS alone, and random ids of near-equal lengths."""
    _, tokenizer = tiny
    rng = random.Random(5)
    out = [tokenizer(text).input_ids for text in TEXTS]
    out.append([1])
    out += [[1] + [rng.randrange(3, 1500) for _ in range(n - 1)] for n in (10, 12, 12, 40)]
    assert len({len(p) for p in out}) >= 7
    return out


@pytest.fixture(scope="session")
def greedy(model):
    """greedy(prompt, n): the first n tokens of `generate(do_sample=False)` for the prompt alone."""
    cache: dict[tuple[int, ...], list[int]] = {}
    config = GenerationConfig(max_new_tokens=REF_LEN, do_sample=False, eos_token_id=None, pad_token_id=0)

    def reference(prompt: list[int], n: int) -> list[int]:
        assert n <= REF_LEN
        key = tuple(prompt)
        if key not in cache:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            cache[key] = out[0, len(prompt):].tolist()
            assert len(cache[key]) == REF_LEN
        return cache[key][:n]

    return reference


def make_engine(model, kv_tokens: int = 4096, max_len: int = 256, **kw) -> Engine:
    """A CPU engine on the portable runner whose pool holds kv_tokens (16-token blocks)."""
    return Engine(model, **{"max_model_len": max_len, "max_kv_tokens": kv_tokens, "runner": "hf", **kw})


def record_steps(engine: Engine) -> list[list[tuple[int, int, int]]]:
    """Spy on engine.launch (every step goes through it): one entry per step,
    (seq_id, start, number of new ids) per row."""
    calls = []
    real = engine.launch

    def launch(rows, after=None, between=None):
        calls.append([(r.seq_id, r.start, len(r.new_ids)) for r in rows])
        return real(rows, after, between)

    engine.launch = launch
    return calls


# --- driving the engine directly --------------------------------------------------------

@dataclass
class Job:
    seq_id: int
    prompt: list[int]
    num_new: int
    join_at: int = 0
    temperature: float = 0.0
    seed: int = 0
    out: list[int] = field(default_factory=list)

    @property
    def is_done(self) -> bool:
        return len(self.out) >= self.num_new

    def row(self) -> StepRow:
        kw = dict(temperature=self.temperature, seed=self.seed)
        if not self.out:
            return StepRow(self.seq_id, list(self.prompt), 0, 0, **kw)
        return StepRow(self.seq_id, [self.out[-1]], len(self.prompt) + len(self.out) - 1, len(self.out), **kw)


def drive(engine: Engine, jobs: list[Job], seed: int = 0, sit_out: float = 0.0, release: bool = True) -> int:
    """Step all jobs to completion in shuffled mixed batches; returns the number of steps."""
    rng = random.Random(seed)
    step = 0
    while not all(j.is_done for j in jobs):
        ready = [j for j in jobs if j.join_at <= step and not j.is_done]
        batch = [j for j in ready if j.out == [] or rng.random() >= sit_out]
        rng.shuffle(batch)
        if batch:
            for job, token in zip(batch, engine.step([j.row() for j in batch])):
                job.out.append(token)
                if job.is_done and release:
                    engine.release(job.seq_id)
        step += 1
        assert step < 500
    return step


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_mixed_batches_match_generate(model, prompts, greedy, runner):
    engine = make_engine(model, runner=runner)
    calls = record_steps(engine)
    jobs = [Job(i, p, num_new=8 + (i * 5) % 13, join_at=(i * 3) % 7) for i, p in enumerate(prompts)]
    drive(engine, jobs, seed=1, sit_out=0.2)
    for job in jobs:
        assert job.out == greedy(job.prompt, job.num_new), f"prompt {job.seq_id} of length {len(job.prompt)}"
    # the schedule really mixed things: prefill beside decode rows, several prefills at once
    assert any(any(n > 1 for _, _, n in c) and any(s > 0 for _, s, _ in c) for c in calls)
    assert any(sum(n > 1 for _, _, n in c) >= 2 for c in calls)


@pytest.mark.parametrize("max_padding", [0.0, 0.25, 10.0])
def test_prefill_grouping_and_padding_do_not_change_tokens(model, prompts, greedy, max_padding):
    engine = make_engine(model, max_padding=max_padding)
    jobs = [Job(i, p, num_new=6) for i, p in enumerate(prompts)]  # all prefill in one step
    drive(engine, jobs, seed=2)
    for job in jobs:
        assert job.out == greedy(job.prompt, 6)


def test_groups_split_prefills_by_length(model):
    engine = make_engine(model, max_padding=0.25)
    engine.step([StepRow(2, [5] * 7, 0, 0)])
    rows = [StepRow(1, [5] * 12, 0, 0), StepRow(2, [5], 7, 1), StepRow(3, [5] * 10, 0, 0),
            StepRow(4, [5] * 3, 0, 0)]
    engine.place(rows)
    batch = StepBatch.build(engine.pool, [r.seq_id for r in rows], [r.new_ids for r in rows],
                            [r.start for r in rows])
    groups = engine.runner.groups(batch)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert [1] in groups  # decode rows run together
    assert [0, 2] in groups and [3] in groups  # 12 and 10 share a padded forward; 3 does not


def test_resuming_from_a_shorter_cached_prefix(model, prompts, greedy):
    """A row may start anywhere inside what is cached: the tail is recomputed."""
    prompt = prompts[0]
    ref = greedy(prompt, 10)
    engine = make_engine(model)
    other = Job(99, prompts[4], num_new=10)
    job = Job(1, prompt, num_new=6)
    drive(engine, [job], release=False)
    ids = prompt + job.out
    assert engine.cached_len(1) == len(ids) - 1
    rows = [StepRow(1, ids[3:], 3, 6), other.row()]
    token, first = engine.step(rows)
    assert token == ref[6] and first == greedy(prompts[4], 1)[0]
    assert engine.cached_len(1) == len(ids)


def test_step_refuses_rows_it_cannot_run(model):
    engine = make_engine(model, max_len=32)
    with pytest.raises(ValueError, match="not here"):
        engine.step([StepRow(1, [5], 4, 1)])
    with pytest.raises(ValueError, match="exceed"):
        engine.step([StepRow(2, [5] * 33, 0, 0)])


def test_a_full_pool_refuses_the_largest_prefill_and_runs_the_rest(model, prompts, greedy):
    engine = make_engine(model, kv_tokens=64, max_len=32)  # 4 blocks of 16
    assert engine.pool.capacity_tokens == 64
    a, b, c = prompts[9][:31], prompts[6], prompts[1]
    assert [engine.pool.blocks_for(len(p)) for p in (a, b, c)] == [2, 1, 1]
    tokens = engine.step([StepRow(1, a, 0, 0), StepRow(2, b, 0, 0), StepRow(3, c, 0, 0),
                          StepRow(4, list(a), 0, 0)])
    # 2 + 1 + 1 + 2 blocks wanted, 4 free: one of the two-block prefills is refused
    assert tokens[0] == REFUSED and engine.cached_len(1) == -1
    assert tokens[1:] == [greedy(b, 1)[0], greedy(c, 1)[0], greedy(a, 1)[0]]
    assert engine.pool.num_free_blocks == 0 and engine.take_evicted() == []


def test_decode_rows_are_refused_from_the_end_when_nothing_can_be_evicted(model, prompts):
    engine = make_engine(model, kv_tokens=48, max_len=32)  # 3 blocks
    p = [1] + [7] * 15  # exactly one block each
    engine.step([StepRow(i, list(p), 0, 0) for i in (1, 2, 3)])
    assert engine.pool.num_free_blocks == 0
    tokens = engine.step([StepRow(i, [9], 16, 1) for i in (1, 2, 3)])  # each needs a second block
    # refusing 3 frees one block: enough for the second row; the first also needs one
    assert tokens[2] == REFUSED and engine.cached_len(3) == -1
    assert tokens[0] == REFUSED or tokens[1] == REFUSED
    assert sum(t != REFUSED for t in tokens) == 1


def test_lru_eviction_spares_the_batch(model, prompts):
    engine = make_engine(model, kv_tokens=32, max_len=16)  # room for two one-block sequences
    p1, p2, p3, p4 = ([1] + [k] * 9 for k in (11, 12, 13, 14))
    engine.step([StepRow(1, p1, 0, 0)])
    engine.step([StepRow(2, p2, 0, 0)])
    # 1 is the least recently used, but it is in the batch: 2 makes room
    engine.step([StepRow(1, [7], len(p1), 1), StepRow(3, p3, 0, 0)])
    assert engine.cached_len(2) == -1 and engine.take_evicted() == [2]
    assert engine.cached_len(1) == len(p1) + 1 and engine.cached_len(3) == len(p3)
    engine.step([StepRow(3, [7], len(p3), 1)])
    engine.step([StepRow(4, p4, 0, 0)])  # now 1 is the least recently used
    assert engine.cached_len(1) == -1 and engine.cached_len(3) == len(p3) + 1
    assert engine.take_evicted() == [1] and engine.take_evicted() == []


def test_blocks_are_reused_and_lengths_grow_across_block_edges(model, prompts, greedy):
    """A sequence crosses several block edges while others come and go in its blocks."""
    p = prompts[4]
    ref = greedy(p, REF_LEN)
    engine = make_engine(model, kv_tokens=160)
    out = []
    rows = [StepRow(1, list(p), 0, 0)]
    for k in range(REF_LEN):
        other = Job(100 + k, prompts[k % 4], num_new=1)
        token = engine.step(rows + [other.row()])[0]
        engine.release(100 + k)
        out.append(token)
        rows = [StepRow(1, [token], len(p) + k, k + 1)]
    assert out == ref
    assert len(engine.pool.blocks[1]) == engine.pool.blocks_for(len(p) + REF_LEN - 1)


def test_a_continued_decode_step_has_the_arrays_a_fresh_build_gives(model):
    """The decode step after a step, derived with array operations, equals a build from the
    pool: rows dropped and reordered, rows opening a block, a sequence holding a block past
    its length (it was cut back), and the table's width growing and shrinking."""
    rng = random.Random(3)
    for trial in range(20):
        engine = make_engine(model, block_size=4)
        pool = engine.pool
        lens = {sid: rng.randint(1, 40) for sid in range(12)}
        for sid, n in lens.items():
            pool.grow(sid, n + (5 if sid == 3 else 0))  # sequence 3 holds blocks past its end
            pool.mark_written([sid], [n])
        prev = StepBatch.build(pool, list(lens), [[7]] * len(lens), [n - 1 for n in lens.values()])
        keep = rng.sample(list(lens), rng.randint(1, len(lens)))
        for sid in keep:
            if len(pool.blocks[sid]) * 4 <= lens[sid]:
                pool.grow(sid, lens[sid] + 1)
        src = [list(lens).index(sid) for sid in keep]
        got = prev.continued(pool, keep, np.asarray(src))
        want = StepBatch.build(pool, keep, [[0]] * len(keep), [lens[s] for s in keep])
        for name in ("ids", "positions", "slot_mapping", "query_start", "seq_lens"):
            assert getattr(got, name).tolist() == getattr(want, name).tolist(), (trial, name)
        assert got.max_query_len == want.max_query_len == 1
        assert got.block_table.shape == want.block_table.shape
        for i, sid in enumerate(keep):  # the columns a row's attention reads
            used = pool.blocks_for(lens[sid] + 1)
            assert got.block_table[i, :used].tolist() == want.block_table[i, :used].tolist(), (trial, sid)


def test_a_step_batch_is_what_its_rows_give_one_at_a_time():
    """build's arrays, made over the whole step at once, against each row's own: decode rows
    and prompts mixed, cached prefixes, sequences holding blocks past their length; and a
    sequence with too few blocks for its positions is refused, not sent to the null block."""
    from qmigrate.engine.kv.pool import BlockPool
    rng = random.Random(11)
    pool = BlockPool(1, 1, 4, 4000, 4, torch.float32, torch.device("cpu"))
    for trial in range(60):
        seq_ids = [100 * trial + i for i in range(rng.randint(1, 10))]
        starts = [rng.randint(0, 50) for _ in seq_ids]
        one = trial % 3 == 0   # steps of decode rows only take build's other branch
        new_ids = [[rng.randint(0, 99) for _ in range(1 if one or rng.random() < 0.6 else rng.randint(2, 30))]
                   for _ in seq_ids]
        for sid, start, new in zip(seq_ids, starts, new_ids):
            pool.grow(sid, start + len(new) + rng.choice([0, 0, 9]))
        batch = StepBatch.build(pool, seq_ids, new_ids, starts)
        assert batch.ids.tolist() == [t for new in new_ids for t in new]
        assert batch.positions.tolist() == [p for st, new in zip(starts, new_ids) for p in range(st, st + len(new))]
        assert batch.slot_mapping.tolist() == [pool.slot(sid, p) for sid, st, new in zip(seq_ids, starts, new_ids)
                                               for p in range(st, st + len(new))]
        assert batch.seq_lens.tolist() == [st + len(new) for st, new in zip(starts, new_ids)]
        width = pool.blocks_for(max(batch.seq_lens.tolist()))
        assert batch.block_table.tolist() == [(pool.blocks[sid] + [0] * width)[:width] for sid in seq_ids]
        assert batch.max_query_len == max(len(n) for n in new_ids)
        for sid in seq_ids:
            pool.release(sid)
    pool.grow(1, 8)
    with pytest.raises(IndexError, match="too few"):
        StepBatch.build(pool, [1], [[5, 6]], [7])


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_steps_that_continue_the_step_before_take_the_array_path(model, prompts, greedy, runner):
    """Decode rows one token on from the step before go the array way, with the same tokens;
    a row with new ids, or one whose KV was dropped meanwhile, sends the step the general way."""
    core = WorkerCore(make_engine(model, runner=runner))
    ids = {i: list(prompts[i]) for i in (0, 1, 5, 6)}
    full = [spec_of(i, p, len(p)) for i, p in ids.items()]
    result, _ = run_steps(core, make_lease(ids, full=full, num_steps=6))
    assert result_tokens(result) == {i: greedy(p, 6) for i, p in ids.items()}
    assert core.engine.num_continued == 5   # every step after the prefill
    engine = core.engine
    first = engine.launch([StepRow(1, list(prompts[1]), 0, 0), StepRow(2, list(prompts[2]), 0, 0)])
    sampled = [StepRow(7, list(prompts[3]), 0, 0, 0.7, 0.9, 5, 11)]   # 0.7 is not a float32
    step = engine.launch(sampled)
    engine.launch([StepRow(7, [], len(prompts[3]), 1, 0.7, 0.9, 5, 11)], after=step)
    assert engine.num_continued == 6
    engine.release(2)
    with pytest.raises(ValueError, match="KV for"):   # the general path finds the KV gone
        engine.launch([StepRow(1, [], len(prompts[1]), 1), StepRow(2, [], len(prompts[2]), 1)], after=first)
    assert engine.num_continued == 6


# --- migration at the engine level ------------------------------------------------------

@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_kv_export_import_continues_identically(model, prompts, greedy, runner):
    prompt = prompts[3]
    ref = greedy(prompt, 16)
    src = make_engine(model, runner=runner)
    job = Job(1, prompt, num_new=6)
    drive(src, [job, Job(2, prompts[0], num_new=3)], release=False)
    assert job.out == ref[:6]
    kv = src.export_kv(1)
    n = len(prompt) + 5  # the last sampled token has not been fed yet
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert kv.shape == (cfg.num_hidden_layers, 2, n, cfg.num_key_value_heads, head_dim)
    assert kv.device.type == "cpu" and kv.is_contiguous()
    assert src.kv_bytes_per_token == kv[:, :, :1].numel() * kv.element_size()

    dst = make_engine(model, kv_tokens=256, runner="fast" if runner == "hf" else "hf")  # across runners
    neighbour = Job(7, prompts[5], num_new=10)
    drive(dst, [Job(8, prompts[2], num_new=2)])  # the destination slot has held something else
    dst.import_kv(1, kv.clone())
    assert dst.cached_len(1) == n
    job.num_new = 16
    drive(dst, [job, neighbour], seed=3)
    assert job.out == ref
    assert neighbour.out == greedy(prompts[5], 10)


def test_recompute_from_ids_continues_identically(model, prompts, greedy):
    prompt = prompts[0]
    ref = greedy(prompt, 14)
    src = make_engine(model)
    job = Job(1, prompt, num_new=5)
    drive(src, [job])
    dst = make_engine(model)
    moved = Job(1, prompt + job.out, num_new=9)  # the full form: prompt and all tokens so far
    token = dst.step([StepRow(1, moved.prompt, 0, 5), Job(2, prompts[1], 1).row()])[0]
    assert token == ref[5]
    rest = [token]
    for i in range(6, 14):
        rest.append(dst.step([StepRow(1, [rest[-1]], len(prompt) + i - 1, i)])[0])
    assert job.out + rest == ref


# --- sampling ---------------------------------------------------------------------------

def rows_of(n: int, temperature=1.0, top_p=1.0, top_k=0, seed=None, index=None) -> SamplingRows:
    full = lambda v: v if isinstance(v, list) else [v] * n
    return SamplingRows.build(full(temperature), full(top_p), full(top_k),
                              full(seed if seed is not None else list(range(n))),
                              full(index if index is not None else 0), "cpu")


def test_uniforms_are_a_pure_function_in_the_open_interval():
    seeds = torch.tensor([0, 1, -1, 42, (1 << 63) - 1, -(1 << 63), 1 << 40, 12345])
    index = torch.tensor([0, 0, 3, 7, (1 << 31) - 1, 1, 5, 1 << 20])
    u = uniforms(seeds, index, 1500)
    assert u.shape == (8, 1500) and u.dtype == torch.float64
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.equal(u, uniforms(seeds.clone(), index.clone(), 1500))
    for i in range(len(seeds)):  # one row at a time gives the same row
        assert torch.equal(u[i], uniforms(seeds[i:i + 1], index[i:i + 1], 1500)[0])
    assert torch.equal(uniforms(seeds, index, 10), u[:, :10])  # a function of the vocab id too
    assert torch.equal(uniforms(seeds.flip(0), index.flip(0), 1500), u.flip(0))
    assert not torch.equal(u[0], u[1])  # the seed matters
    assert not torch.equal(uniforms(seeds, index + 1, 1500), u)  # the index matters


def test_uniforms_look_uniform():
    u = uniforms(torch.arange(200), torch.arange(200) % 7, 1000).flatten()
    counts = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    assert bool(((counts - 20_000).abs() < 600).all()), counts
    assert abs(float(u.mean()) - 0.5) < 0.005


def test_sampled_rows_do_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=gen) * 3
    params = dict(temperature=[0.0, 0.7, 1.0, 1.5, 0.9, 1.0, 0.0, 2.0],
                  top_p=[1.0, 0.9, 1.0, 0.5, 1.0, 0.95, 1.0, 1.0],
                  top_k=[0, 0, 50, 0, 5, 20, 3, 0],
                  seed=[11, 12, 13, 14, 15, 16, 17, 18], index=[0, 4, 9, 2, 2, 31, 5, 1])
    full = sample(logits, rows_of(8, **params)).tolist()
    assert full[0] == int(logits[0].argmax()) and full[6] == int(logits[6].argmax())
    rng = random.Random(1)
    for _ in range(20):
        pick = rng.sample(range(8), rng.randint(1, 8))
        sub = {k: [v[i] for i in pick] for k, v in params.items()}
        assert sample(logits[pick], rows_of(len(pick), **sub)).tolist() == [full[i] for i in pick]


def test_top_k_one_and_tiny_top_p_are_greedy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 500, generator=gen) * 2
    greedy = logits.argmax(dim=-1)
    for index in range(5):
        assert torch.equal(sample(logits, rows_of(64, temperature=1.5, top_k=1, index=index)), greedy)
        assert torch.equal(sample(logits, rows_of(64, temperature=1.5, top_p=1e-6, index=index)), greedy)
    assert not torch.equal(sample(logits, rows_of(64, temperature=1.5)), greedy)  # sampling is on


def test_temperature_zero_is_greedy_whatever_the_seed():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample(logits, rows_of(16, temperature=0.0, top_k=7, top_p=0.5)), logits.argmax(-1))


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
N_DRAWS = 20_000


def draw_counts(temperature: float, top_k: int = 0, top_p: float = 1.0, vary: str = "seed") -> torch.Tensor:
    steps = list(range(N_DRAWS))
    seed, index = (steps, 3) if vary == "seed" else (7, steps)
    rows = rows_of(N_DRAWS, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, index=index)
    tokens = sample(LOGITS.expand(N_DRAWS, -1).contiguous(), rows)
    return torch.bincount(tokens, minlength=len(LOGITS)).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    kept = probs > 0
    assert float(counts[~kept].sum()) == 0, "drew a token that was filtered out"
    expected = probs[kept].double() * counts.sum()
    return float(((counts[kept] - expected) ** 2 / expected).sum())


def renormalised(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


# With k - 1 degrees of freedom (at most 4 here), chi-square exceeds 20 with probability
# below 0.0005; the draws are deterministic, so these tests cannot flake.
CHI2_LIMIT = 20.0


@pytest.mark.parametrize("vary", ["seed", "index"])
@pytest.mark.parametrize("temperature", [0.8, 1.0, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature, vary):
    counts = draw_counts(temperature, vary=vary)
    assert chi_square(counts, torch.softmax(LOGITS / temperature, -1)) < CHI2_LIMIT
    wrong = torch.softmax(LOGITS / (temperature * 1.5), -1)
    assert chi_square(counts, wrong) > 10 * CHI2_LIMIT  # the check has the power to fail


def test_frequencies_with_top_k_and_top_p():
    probs = torch.softmax(LOGITS / 0.8, -1)  # about [.647, .186, .099, .053, .015]
    assert chi_square(draw_counts(0.8, top_k=2), renormalised(probs, [0, 1])) < CHI2_LIMIT
    # top_p 0.9 keeps tokens whose more likely tokens hold at most 0.9: .647 + .186 < .9 < + .099
    assert chi_square(draw_counts(0.8, top_p=0.9), renormalised(probs, [0, 1, 2])) < CHI2_LIMIT
    # top_k first (renormalised to [.78, .22]), then top_p 0.5 keeps the first alone
    assert draw_counts(0.8, top_k=2, top_p=0.5).tolist() == [N_DRAWS, 0, 0, 0, 0]


def test_engine_sampling_does_not_depend_on_the_batch(model, prompts):
    def sampled(job_ids: list[int], seed: int) -> dict[int, list[int]]:
        jobs = [Job(i, prompts[i], num_new=10, join_at=i % 3, temperature=1.0, seed=100 + i) for i in job_ids]
        drive(make_engine(model), jobs, seed=seed, sit_out=0.3)
        return {j.seq_id: j.out for j in jobs}

    alone = {i: sampled([i], 0)[i] for i in (0, 3, 5)}
    together = sampled([0, 1, 2, 3, 4, 5, 8], seed=4)
    assert {i: together[i] for i in alone} == alone
    assert len({tuple(v) for v in alone.values()}) == 3


# --- WorkerCore: a router stand-in ------------------------------------------------------

def spec_of(seq_id: int, ids: list[int], prompt_len: int, max_new_tokens: int = 64, **kw) -> P.SeqSpec:
    return P.SeqSpec(seq_id, P.pack_i32(ids), prompt_len, max_new_tokens, **kw)


def make_lease(ids: dict[int, list[int]], full: list[P.SeqSpec] = (), num_steps: int = 1,
               drop_ids: list[int] = (), lease_id: int = 1, lengths: dict[int, int] | None = None) -> P.Lease:
    """Rows for ids' sequences (the router's view: prompt + tokens so far); `full` rows carry specs."""
    lengths = lengths or {}
    sids = list(ids)
    return P.Lease(lease_id, lease_id, 10.0, P.pack_i64(sids),
                   P.pack_i32([lengths.get(s, len(ids[s])) for s in sids]),
                   P.pack_i32([ids[s][-1] if ids[s] else 0 for s in sids]), list(full),
                   P.pack_i64(list(drop_ids)), num_steps)


@dataclass
class Ran:
    tokens: dict[int, list[int]]      # per sequence, from the step result
    status: dict[int, Finish]
    emitted: dict[int, tuple[int, list[int], Finish]]  # the detokenizer's view: start, tokens, finish
    free_kv_tokens: int


def run(core: WorkerCore, lease: P.Lease) -> Ran:
    result, tokens = core.run(lease)
    result, tokens = codec.decode(codec.encode(result)), codec.decode(codec.encode(tokens))  # they travel
    assert result.lease_id == lease.lease_id
    sids = P.unpack_i64(result.seq_ids).tolist()
    assert sids == P.unpack_i64(lease.seq_ids).tolist()
    counts, flat = P.unpack_i32(result.counts).tolist(), P.unpack_i32(result.tokens).tolist()
    assert sum(counts) == len(flat)
    out, pos = {}, 0
    for sid, n in zip(sids, counts):
        out[sid], pos = flat[pos:pos + n], pos + n
    status = dict(zip(sids, map(Finish, P.unpack_u8(result.status).tolist())))
    t_sids, starts = P.unpack_i64(tokens.seq_ids).tolist(), P.unpack_i32(tokens.start).tolist()
    t_counts, t_flat = P.unpack_i32(tokens.counts).tolist(), P.unpack_i32(tokens.tokens).tolist()
    finish = P.unpack_u8(tokens.finish).tolist()
    emitted, pos = {}, 0
    for sid, start, n, code in zip(t_sids, starts, t_counts, finish):
        emitted[sid], pos = (start, t_flat[pos:pos + n], Finish(code)), pos + n
    assert pos == len(t_flat)
    return Ran(out, status, emitted, result.free_kv_tokens)


def advance(ids: dict[int, list[int]], ran: Ran) -> None:
    """The router's bookkeeping: append new tokens, forget finished sequences."""
    for sid, toks in ran.tokens.items():
        if ran.status[sid].is_finished:
            ids.pop(sid)
        else:
            ids[sid] += toks


def first_new_position(tokens: list[int], at_least: int) -> int:
    """An index i >= at_least whose token does not occur before i."""
    return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture
def core(model) -> WorkerCore:
    return WorkerCore(make_engine(model))


def test_worker_runs_full_forms_then_diffs(core, prompts, greedy):
    a, b = prompts[0], prompts[3]
    ids = {1: list(a), 2: list(b)}
    ran = run(core, make_lease(ids, full=[spec_of(1, a, len(a)), spec_of(2, b, len(b))]))
    assert ran.emitted[1] == (0, greedy(a, 1), Finish.NONE) and ran.emitted[2][:2] == (0, greedy(b, 1))
    advance(ids, ran)
    for k in range(1, 6):
        ran = run(core, make_lease(ids, lease_id=k + 1))
        assert ran.status == {1: Finish.NONE, 2: Finish.NONE}
        assert ran.emitted[1] == (k, [greedy(a, k + 1)[k]], Finish.NONE)
        assert ran.emitted[2][0] == k
        advance(ids, ran)
    assert ids[1] == a + greedy(a, 6) and ids[2] == b + greedy(b, 6)
    held = sum(core.engine.pool.blocks_for(len(v) - 1) for v in ids.values())
    assert ran.free_kv_tokens == core.engine.free_tokens == core.engine.pool.capacity_tokens - 16 * held


def test_diff_for_an_unknown_sequence_needs_ids(core, prompts):
    calls = record_steps(core.engine)
    ran = run(core, make_lease({5: prompts[0]}))
    assert ran.status == {5: Finish.NEED_IDS} and ran.tokens == {5: []}
    assert ran.emitted == {}  # nothing for the detokenizer
    assert calls == []


def test_diff_after_eviction_or_drop_needs_ids(model, prompts, greedy):
    core = WorkerCore(make_engine(model, kv_tokens=16, max_len=16))  # one block
    a, b = prompts[0], prompts[1]
    ids = {1: list(a)}
    advance(ids, run(core, make_lease(ids, full=[spec_of(1, a, len(a))])))
    run(core, make_lease({2: list(b)}, full=[spec_of(2, b, len(b))]))  # evicts sequence 1
    assert run(core, make_lease(ids)).status == {1: Finish.NEED_IDS}
    ids = {2: list(b) + greedy(b, 1)}
    assert run(core, make_lease(ids, drop_ids=[2])).status == {2: Finish.NEED_IDS}
    assert 2 not in core.seqs


def test_diff_that_does_not_match_the_cache_needs_ids(core, prompts):
    a = prompts[0]
    ids = {1: list(a)}
    advance(ids, run(core, make_lease(ids, full=[spec_of(1, a, len(a))])))
    ran = run(core, make_lease(ids, lengths={1: len(ids[1]) + 2}))  # claims two tokens we never saw
    assert ran.status == {1: Finish.NEED_IDS}
    bad = {1: ids[1][:-1] + [core.engine.shape.vocab_size]}  # an out-of-vocabulary last token
    assert run(core, make_lease(bad)).status == {1: Finish.NEED_IDS}


def test_eos_ends_a_row(core, prompts, greedy):
    a = prompts[0]
    ref = greedy(a, REF_LEN)
    i = first_new_position(ref, 2)
    ids = {1: list(a)}
    unused = min(set(range(3, 1500)) - set(ref))
    full = [spec_of(1, a, len(a), eos_ids=[unused, ref[i]])]
    for k in range(i + 1):
        ran = run(core, make_lease(ids, full=full if k == 0 else [], lease_id=k + 1))
        code = Finish.EOS if k == i else Finish.NONE
        assert ran.status == {1: code} and ran.emitted == {1: (k, [ref[k]], code)}
        advance(ids, ran)
    assert 1 not in core.seqs and core.engine.cached_len(1) == -1  # its KV is freed


def test_eos_inside_a_multi_step_lease(core, prompts, greedy):
    a = prompts[4]
    ref = greedy(a, REF_LEN)
    i = first_new_position(ref, 3)
    ran = run(core, make_lease({1: list(a)}, full=[spec_of(1, a, len(a), eos_ids=[ref[i]])], num_steps=20))
    assert ran.tokens == {1: ref[:i + 1]} and ran.emitted == {1: (0, ref[:i + 1], Finish.EOS)}


def test_max_new_tokens_ends_a_row(core, prompts, greedy):
    a, b = prompts[0], prompts[2]
    ids = {1: list(a), 2: list(b)}
    full = [spec_of(1, a, len(a), max_new_tokens=4), spec_of(2, b, len(b), max_new_tokens=2)]
    ran = run(core, make_lease(ids, full=full, num_steps=3))
    assert ran.tokens == {1: greedy(a, 3), 2: greedy(b, 2)}
    assert ran.status == {1: Finish.NONE, 2: Finish.LENGTH}
    assert ran.emitted == {1: (0, greedy(a, 3), Finish.NONE), 2: (0, greedy(b, 2), Finish.LENGTH)}
    advance(ids, ran)
    ran = run(core, make_lease(ids, num_steps=3, lease_id=2))
    assert ran.emitted == {1: (3, greedy(a, 4)[3:], Finish.LENGTH)}


def test_stop_sequence_ends_a_row_across_leases(core, prompts, greedy):
    a = prompts[3]
    ref = greedy(a, REF_LEN)
    i = first_new_position(ref, 2)
    stop = [[ref[i - 1], ref[i]], [ref[i], ref[i]], [1499, 1498, 1497]]
    ids = {1: list(a)}
    full = [spec_of(1, a, len(a), stop_ids=stop)]
    for k in range(i + 1):
        ran = run(core, make_lease(ids, full=full if k == 0 else [], lease_id=k + 1))
        assert ran.emitted[1] == (k, [ref[k]], Finish.STOP if k == i else Finish.NONE)
        advance(ids, ran)


def test_stop_sequence_that_began_before_a_migration(core, prompts, greedy):
    a = prompts[3]
    ref = greedy(a, REF_LEN)
    i = first_new_position(ref, 2)
    ids = a + ref[:i]  # the sequence arrives with i tokens generated elsewhere
    spec = spec_of(1, ids, len(a), stop_ids=[[ref[i - 1], ref[i]]])
    ran = run(core, make_lease({1: ids}, full=[spec]))
    assert ran.emitted == {1: (i, [ref[i]], Finish.STOP)}


def test_several_steps_per_dispatch(core, prompts, greedy):
    ids = {i: list(prompts[i]) for i in (0, 1, 5)}
    full = [spec_of(i, p, len(p)) for i, p in ids.items()]
    ran = run(core, make_lease(ids, full=full, num_steps=4))
    for i, p in ((0, prompts[0]), (1, prompts[1]), (5, prompts[5])):
        assert ran.emitted[i] == (0, greedy(p, 4), Finish.NONE)
    advance(ids, ran)
    ran = run(core, make_lease(ids, num_steps=3, lease_id=2))
    assert ran.emitted[0] == (4, greedy(prompts[0], 7)[4:], Finish.NONE)
    assert core.num_steps == 7


def test_out_of_vocabulary_ids_are_an_error_for_that_row_only(core, prompts, greedy):
    vocab = core.engine.shape.vocab_size
    good, bad = prompts[0], [1, 5, vocab, 7]
    ids = {1: list(good), 2: bad, 3: [1, 9, vocab + 1000]}
    full = [spec_of(1, good, len(good)), spec_of(2, bad, 2), spec_of(3, ids[3], 3)]
    ran = run(core, make_lease(ids, full=full))
    assert ran.status == {1: Finish.NONE, 2: Finish.ERROR, 3: Finish.ERROR}
    assert ran.tokens == {1: greedy(good, 1), 2: [], 3: []}
    # The error record starts after the tokens other workers already generated (2 for row 2).
    assert ran.emitted[2] == (2, [], Finish.ERROR) and ran.emitted[3] == (0, [], Finish.ERROR)
    assert 2 not in core.seqs and 3 not in core.seqs


@pytest.mark.parametrize("case", ["length mismatch", "empty", "no prompt", "too long"])
def test_inconsistent_full_forms_are_errors(core, prompts, case):
    p = prompts[0]
    spec, length = {
        "length mismatch": (spec_of(1, p, len(p)), len(p) + 1),
        "empty": (spec_of(1, [], 0), 0),
        "no prompt": (spec_of(1, p, 0), len(p)),
        "too long": (spec_of(1, [5] * 300, 300), 300),  # the engine holds 256 positions
    }[case]
    lease = P.Lease(1, 1, 10.0, P.pack_i64([1]), P.pack_i32([length]), P.pack_i32([5]), [spec])
    ran = run(core, lease)
    assert ran.status == {1: Finish.ERROR} and ran.emitted[1][1:] == ([], Finish.ERROR)


def test_an_error_after_migration_reports_the_tokens_already_generated(core):
    """The detokenizer ends a request at start + count: after 60 generated tokens it must
    wait for all 60, not end the request at 0."""
    ids = [1] + [5] * 239 + [9] * 60  # 240 prompt + 60 generated = 300 > 256 positions
    ran = run(core, make_lease({1: ids}, full=[spec_of(1, ids, 240)]))
    assert ran.status == {1: Finish.ERROR}
    assert ran.emitted[1] == (60, [], Finish.ERROR)


def test_negative_ids_are_a_protocol_error_not_a_crash(core):
    ids = [1, -5, 7]
    lease = P.Lease(1, 1, 10.0, P.pack_i64([1]), P.pack_i32([3]), P.pack_i32([7]), [spec_of(1, ids, 2)])
    with pytest.raises(P.ProtocolError):
        core.run(lease)


def test_seeded_sampling_is_the_same_wherever_it_runs(model, prompts, greedy):
    p = prompts[4]

    def generate(num_cores: int, neighbours: bool, seed: int) -> list[int]:
        """8 tokens of seq 1, moved by recompute across num_cores workers, maybe in company."""
        cores = [WorkerCore(make_engine(model)) for _ in range(num_cores)]
        ids = {1: list(p)}
        for k in range(8):
            core = cores[k * num_cores // 8]
            here, full = dict(ids), []
            if core.engine.cached_len(1) < 0:
                full.append(spec_of(1, ids[1], len(p), temperature=1.0, top_p=0.95, seed=seed))
            if neighbours:
                q = prompts[k % 4]
                here[50 + k] = list(q)
                full.append(spec_of(50 + k, q, len(q), temperature=0.7, seed=k))
            ids[1] += run(core, make_lease(here, full=full, lease_id=k + 1)).tokens[1]
        return ids[1][len(p):]

    alone = generate(1, neighbours=False, seed=4242)
    assert generate(3, neighbours=True, seed=4242) == alone
    assert alone != greedy(p, 8)  # it really sampled
    assert generate(1, neighbours=False, seed=4243) != alone
    # no seed: the sequence id stands in, so the output is still reproducible
    assert generate(1, neighbours=False, seed=-1) == generate(2, neighbours=True, seed=-1)


# --- WorkerCore: KV transfer ------------------------------------------------------------

def run_on(core: WorkerCore, prompt: list[int], num_tokens: int, seq_id: int = 1) -> list[int]:
    """Run a sequence for num_tokens one-step leases; returns prompt + generated ids."""
    ids = {seq_id: list(prompt)}
    for k in range(num_tokens):
        full = [spec_of(seq_id, prompt, len(prompt))] if k == 0 else []
        advance(ids, run(core, make_lease(ids, full=full, lease_id=100 + k)))
    return ids[seq_id]


def moved_spec(ids: list[int], prompt_len: int, transfer_id: int, seq_id: int = 1) -> P.SeqSpec:
    return spec_of(seq_id, ids, prompt_len, kv_from="tcp://10.0.0.1:5601", transfer_id=transfer_id)


def test_kv_transfer_is_used_instead_of_recompute(model, prompts, greedy):
    a = prompts[3]
    ref = greedy(a, 10)
    src, dst = WorkerCore(make_engine(model)), WorkerCore(make_engine(model))
    ids = run_on(src, a, 4)
    kv = src.export(1, len(ids) - 1)
    assert kv is not None and kv.shape[2] == len(ids) - 1
    assert src.engine.cached_len(1) == -1 and 1 not in src.seqs  # shipped means forgotten
    lease = make_lease({1: ids}, full=[moved_spec(ids, len(a), 77)])
    assert dst.awaited_transfers(lease) == {77}
    dst.receive_transfer(77, 1, kv)
    assert dst.awaited_transfers(lease) == set()
    calls = record_steps(dst.engine)
    ran = run(dst, lease)
    assert calls == [[(1, len(ids) - 1, 1)]]  # a decode row: nothing was prefilled
    assert ran.emitted == {1: (4, [ref[4]], Finish.NONE)}
    assert dst.num_kv_imported == 1
    ids += ran.tokens[1]
    for k in range(5, 10):
        ran = run(dst, make_lease({1: ids}, lease_id=k))
        ids += ran.tokens[1]
    assert ids == a + ref


@pytest.mark.parametrize("damage", ["short", "long", "missing", "empty"])
def test_unusable_transfer_falls_back_to_recompute(model, prompts, greedy, damage):
    a = prompts[0]
    src, dst = WorkerCore(make_engine(model)), WorkerCore(make_engine(model))
    ids = run_on(src, a, 3)
    kv = src.engine.export_kv(1)
    kv = {"short": kv[:, :, :-1], "long": torch.cat([kv, kv[:, :, -1:]], dim=2),
          "missing": None, "empty": None}[damage]
    if damage != "missing":
        dst.receive_transfer(5, 1, kv)
    calls = record_steps(dst.engine)
    ran = run(dst, make_lease({1: ids}, full=[moved_spec(ids, len(a), 5)]))
    if damage == "short":   # fewer positions than moved (as a pulled prefix): placed, the rest computed
        shipped = kv.shape[2]
        assert calls == [[(1, shipped, len(ids) - shipped)]] and dst.num_kv_imported == 1
    else:
        assert calls == [[(1, 0, len(ids))]]  # prefilled from the ids
        assert dst.num_kv_imported == 0
    assert ran.emitted == {1: (3, [greedy(a, 4)[3]], Finish.NONE)}
    assert 5 not in dst.transfers


def test_transfer_of_the_wrong_shape_falls_back_to_recompute(model, prompts, greedy):
    """A shipment from a worker with another KV layout (heads, layers) must not crash this one."""
    a = prompts[0]
    src, dst = WorkerCore(make_engine(model)), WorkerCore(make_engine(model))
    ids = run_on(src, a, 3)
    kv = src.export(1, len(ids) - 1)
    dst.receive_transfer(5, 1, torch.cat([kv, kv], dim=3))  # twice the KV heads, right length
    ran = run(dst, make_lease({1: ids}, full=[moved_spec(ids, len(a), 5)]))
    assert ran.emitted == {1: (3, [greedy(a, 4)[3]], Finish.NONE)}
    assert dst.num_kv_imported == 0


def test_importing_a_transfer_never_evicts_a_row_of_the_same_lease(model, prompts, greedy):
    """Two slots, both full. The lease runs seq 1 (cached, least recently used) and seq 2
    (arriving by transfer): making room for 2 must evict seq 3, which is not in the lease."""
    src = WorkerCore(make_engine(model))
    ids2 = run_on(src, prompts[1], 3, seq_id=2)
    kv = src.export(2, len(ids2) - 1)
    blocks = lambda p, n: -(-(len(p) + n) // 16)
    room = blocks(prompts[0], 2) + max(blocks(prompts[4], 1), blocks(prompts[1], 3))
    dst = WorkerCore(make_engine(model, kv_tokens=16 * room, max_len=16 * room))
    ids1 = run_on(dst, prompts[0], 2, seq_id=1)
    run_on(dst, prompts[4], 1, seq_id=3)  # now the most recently used
    dst.receive_transfer(9, 2, kv)
    lease = make_lease({1: ids1, 2: ids2}, full=[moved_spec(ids2, len(prompts[1]), 9, seq_id=2)])
    ran = run(dst, lease)
    assert ran.status == {1: Finish.NONE, 2: Finish.NONE}
    assert ran.tokens == {1: greedy(prompts[0], 3)[2:], 2: greedy(prompts[1], 4)[3:]}
    assert dst.engine.cached_len(3) == -1


def test_export_of_a_sequence_that_is_not_held_is_none(core, prompts):
    assert core.export(1, 5) is None
    ids = run_on(core, prompts[0], 2)
    assert core.export(1, len(ids)) is None  # asks for more than is cached
    assert core.engine.cached_len(1) == -1  # and forgets it all the same


def test_transfers_kept_are_bounded(model):
    core = WorkerCore(make_engine(model))
    for tid in range(1, MAX_TRANSFERS + 12):
        core.receive_transfer(tid, tid, None)
    assert len(core.transfers) == MAX_TRANSFERS and MAX_TRANSFERS + 11 in core.transfers and 1 not in core.transfers


def test_a_resync_resends_earlier_tokens_before_the_new_one(core, prompts, greedy):
    p = prompts[0]
    done = greedy(p, 3)
    ids = {1: list(p) + done}
    ran = run(core, make_lease(ids, full=[spec_of(1, ids[1], len(p), resend_from=0)]))
    start, tokens, _ = ran.emitted[1]
    assert start == 0 and tokens == done + greedy(p, 4)[3:]


def test_a_chained_row_feeds_the_token_its_previous_step_sampled(core, prompts, greedy):
    p = prompts[1]
    ids = {1: list(p)}
    first = run(core, make_lease(ids, full=[spec_of(1, ids[1], len(p))]))
    chained = P.Lease(2, 2, 10.0, P.pack_i64([1]), P.pack_i32([P.CONTINUE]), P.pack_i32([P.CONTINUE]))
    second = run(core, chained)
    assert first.tokens[1] + second.tokens[1] == greedy(p, 2)
    assert second.emitted[1][0] == 1  # generated-token index of what it sampled
    unknown = P.Lease(3, 3, 10.0, P.pack_i64([99]), P.pack_i32([P.CONTINUE]), P.pack_i32([P.CONTINUE]))
    assert run(core, unknown).status[99] == Finish.NEED_IDS


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_a_step_launched_before_the_last_is_collected_feeds_its_tokens(model, prompts, greedy, runner):
    """Step N+1 is built and launched while step N is in flight; rows with no new_ids take
    the token step N samples for them, which never passes through the host first."""
    engine = make_engine(model, runner=runner)
    jobs = {i: prompts[i] for i in (0, 3, 4, 6)}
    pending = engine.launch([StepRow(i, list(p), 0, 0) for i, p in jobs.items()])
    out = {i: [] for i in jobs}
    for k in range(1, 12):
        rows = [StepRow(i, [], len(p) + k - 1, k) for i, p in jobs.items()]
        if k == 5:  # a newcomer joins mid-stream beside the fed rows
            rows.append(StepRow(99, list(prompts[1]), 0, 0))
        nxt = engine.launch(rows, after=pending)
        for row, token in zip(pending.rows, engine.collect(pending)):
            if row.seq_id in out:
                out[row.seq_id].append(token)
        pending = nxt
    for row, token in zip(pending.rows, engine.collect(pending)):
        if row.seq_id in out:
            out[row.seq_id].append(token)
    for i, p in jobs.items():
        assert out[i] == greedy(p, 12), i
    with pytest.raises(ValueError, match="did not sample"):
        engine.launch([StepRow(1234, [], 5, 1)], after=pending)


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_long_prompts_fill_their_kv_in_chunks(model, prompts, greedy, runner):
    engine = make_engine(model, runner=runner, prefill_chunk=8)
    calls = []
    long, short = prompts[9], prompts[1]          # 40 tokens: 4 chunks of 8 before the step
    rows = [StepRow(1, list(long), 0, 0), StepRow(2, list(short), 0, 0)]
    tokens = engine.collect(engine.launch(rows, between=lambda: calls.append(engine.cached_len(1))))
    assert calls == [8, 16, 24, 32]
    assert tokens == [greedy(long, 1)[0], greedy(short, 1)[0]]
    assert engine.cached_len(1) == len(long)


def test_a_multi_step_lease_chained_on_the_device_runs_on_from_the_fed_token(core, prompts, greedy):
    """A lease started before the previous one is collected feeds its first token on the
    device; its later steps must then start one position further on."""
    ps = {1: list(prompts[1]), 2: list(prompts[2])}
    first = core.start(make_lease(ps, full=[spec_of(i, p, len(p)) for i, p in ps.items()]))
    chained = P.Lease(2, 2, 10.0, P.pack_i64([1, 2]), P.pack_i32([P.CONTINUE] * 2),
                      P.pack_i32([P.CONTINUE] * 2), [], b"", 5)
    second = core.start(chained, after=first)
    a, _ = core.finish(first)
    b, _ = core.finish(second)
    got = {sid: [] for sid in ps}
    for res in (a, b):
        counts = P.unpack_i32(res.counts).tolist()
        tokens = iter(P.unpack_i32(res.tokens).tolist())
        for sid, n in zip(P.unpack_i64(res.seq_ids).tolist(), counts):
            got[sid] += [next(tokens) for _ in range(n)]
    for sid, p in ps.items():
        assert got[sid] == greedy(p, 6), sid


# --- WorkerCore: multi-step leases, streamed step by step, and revokes -------------------

def decode_tokens(msg: P.Tokens) -> dict[int, tuple[int, list[int], int]]:
    msg = codec.decode(codec.encode(msg))
    out, pos = {}, 0
    for sid, start, n, code in zip(P.unpack_i64(msg.seq_ids).tolist(), P.unpack_i32(msg.start).tolist(),
                                   P.unpack_i32(msg.counts).tolist(), P.unpack_u8(msg.finish).tolist()):
        out[sid], pos = (start, P.unpack_i32(msg.tokens).tolist()[pos:pos + n], code), pos + n
    return out


def result_tokens(result: P.StepResult) -> dict[int, list[int]]:
    sids, counts = P.unpack_i64(result.seq_ids).tolist(), P.unpack_i32(result.counts).tolist()
    flat, out, pos = P.unpack_i32(result.tokens).tolist(), {}, 0
    for sid, n in zip(sids, counts):
        out[sid], pos = flat[pos:pos + n], pos + n
    return out


def run_steps(core: WorkerCore, lease: P.Lease, revoke_at: dict | None = None, revoked=frozenset()):
    """Run a lease, recording each step's Tokens; revoke_at[k]: the rows revoked as of the
    k-th call between steps (None: every row)."""
    streamed, current = [], [revoked]

    def on_step(tokens):
        streamed.append(decode_tokens(tokens))
        current[0] = (revoke_at or {}).get(len(streamed), current[0])
        return current[0]

    result, final = core.finish(core.start(lease), on_step, revoked)
    streamed.append(decode_tokens(final))
    return result, streamed


def test_a_multi_step_lease_streams_every_step_and_answers_once(core, prompts, greedy):
    ids = {i: list(prompts[i]) for i in (0, 1, 5, 6)}
    full = [spec_of(i, p, len(p)) for i, p in ids.items()]
    result, streamed = run_steps(core, make_lease(ids, full=full, num_steps=5))
    assert len(streamed) == 5                     # four calls between steps, then the final Tokens
    for k, step in enumerate(streamed):
        assert step == {i: (k, [greedy(p, 5)[k]], 0) for i, p in ids.items()}, k
    assert result_tokens(result) == {i: greedy(p, 5) for i, p in ids.items()}
    assert P.unpack_u8(result.status).tolist() == [Finish.NONE] * 4


def test_revoked_rows_stop_at_the_next_step_boundary_and_keep_their_kv(core, prompts, greedy):
    ids = {i: list(prompts[i]) for i in (0, 3, 6)}
    full = [spec_of(i, p, len(p)) for i, p in ids.items()]
    # Revoked in the call after step 2: step 3 is already launched, so row 3 ends with 3 tokens.
    result, streamed = run_steps(core, make_lease(ids, full=full, num_steps=6), {2: frozenset({3})})
    got = result_tokens(result)
    assert got == {0: greedy(ids[0], 6), 3: greedy(ids[3], 3), 6: greedy(ids[6], 6)}
    assert sum(len(s.get(3, (0, []))[1]) for s in streamed) == 3  # each token streamed once
    assert P.unpack_u8(result.status).tolist() == [Finish.NONE] * 3
    # It goes on here from its KV (a diff), exactly as if it had never stopped.
    ids = {3: ids[3] + got[3]}
    result, _ = run_steps(core, make_lease(ids, num_steps=3, lease_id=2))
    assert result_tokens(result) == {3: greedy(prompts[3], 6)[3:]}


def test_revoking_every_row(core, prompts, greedy):
    ids = {i: list(prompts[i]) for i in (1, 4)}
    full = [spec_of(i, p, len(p)) for i, p in ids.items()]
    result, streamed = run_steps(core, make_lease(ids, full=full, num_steps=8), {1: None})
    assert result_tokens(result) == {i: greedy(p, 2) for i, p in ids.items()} and len(streamed) == 2
    # Revoked before it started: every row runs its first step only.
    ids = {i: ids[i] + greedy(ids[i], 2) for i in ids}
    result, streamed = run_steps(core, make_lease(ids, num_steps=8, lease_id=2), revoked=None)
    assert result_tokens(result) == {i: [greedy(prompts[i], 3)[2]] for i in ids} and len(streamed) == 1


def test_a_chained_row_runs_several_steps_from_the_token_on_the_device(core, prompts, greedy):
    p = prompts[2]
    first = core.start(make_lease({1: list(p)}, full=[spec_of(1, p, len(p))]))
    chained = P.Lease(2, 2, 10.0, P.pack_i64([1]), P.pack_i32([P.CONTINUE]), P.pack_i32([P.CONTINUE]),
                      num_steps=4)
    second = core.start(chained, after=first)      # launched before the first step is collected
    result1, _ = core.finish(first)
    result2, tokens2 = core.finish(second)
    assert result_tokens(result1)[1] + result_tokens(result2)[1] == greedy(p, 5)
    assert decode_tokens(tokens2)[1][0] == 1


def test_rows_that_end_inside_a_multi_step_lease_are_announced_once(core, prompts, greedy):
    a, b = prompts[0], prompts[5]
    ids = {1: list(a), 2: list(b)}
    full = [spec_of(1, a, len(a), max_new_tokens=2), spec_of(2, b, len(b), eos_ids=[greedy(b, 3)[2]])]
    result, streamed = run_steps(core, make_lease(ids, full=full, num_steps=6))
    assert result_tokens(result) == {1: greedy(a, 2), 2: greedy(b, 3)}
    assert P.unpack_u8(result.status).tolist() == [Finish.LENGTH, Finish.EOS]
    ends = [(sid, code) for step in streamed for sid, (_, _, code) in step.items() if code]
    assert ends == [(1, Finish.LENGTH), (2, Finish.EOS)]
    assert 1 not in core.seqs and 2 not in core.seqs


def test_the_next_lease_launches_behind_the_last_step_of_a_multi_step_lease(core, prompts, greedy):
    """While a multi-step lease is finished, the next lease may start once the last step is
    launched; its chained rows feed from that last step, on the device."""
    ps = {1: list(prompts[1]), 2: list(prompts[2])}
    first = core.start(make_lease(ps, full=[spec_of(i, p, len(p)) for i, p in ps.items()]))
    core.finish(first)
    seq_ids = P.pack_i64([1, 2])
    a = core.start(P.Lease(2, 2, 10.0, seq_ids, P.pack_i32([P.CONTINUE] * 2), P.pack_i32([P.CONTINUE] * 2),
                           [], b"", 3))
    b_lease = P.Lease(3, 3, 10.0, seq_ids, P.pack_i32([P.CONTINUE] * 2), P.pack_i32([P.CONTINUE] * 2),
                      [], b"", 4)
    behind = []

    def launch_next():
        assert not behind  # once, when the last step is on the device and not yet collected
        behind.append(core.start(b_lease, after=a))
        assert behind[0].rows and all(not r.new_ids for r in behind[0].rows)  # fed on the device

    res_a, _ = core.finish(a, on_last_launch=launch_next)
    res_b, _ = core.finish(behind[0])
    got = {1: [], 2: []}
    for res in (res_a, res_b):
        counts = P.unpack_i32(res.counts).tolist()
        tokens = iter(P.unpack_i32(res.tokens).tolist())
        for sid, n in zip(P.unpack_i64(res.seq_ids).tolist(), counts):
            got[sid] += [next(tokens) for _ in range(n)]
    first_tokens = greedy(ps[1], 1), greedy(ps[2], 1)
    for (sid, p), head in zip(ps.items(), first_tokens):
        assert head + got[sid] == greedy(p, 8), sid


def test_a_row_cut_short_for_room_keeps_the_tokens_it_streamed(model, greedy):
    core = WorkerCore(make_engine(model, kv_tokens=16, max_len=16, block_size=8))  # two blocks
    p, q = [1] + list(range(100, 106)), [1] + list(range(200, 206))  # a block each, for 2 steps
    ids = {1: p, 2: q}
    full = [spec_of(i, s, len(s)) for i, s in ids.items()]
    result, streamed = run_steps(core, make_lease(ids, full=full, num_steps=4))
    got = result_tokens(result)
    assert got[2] == greedy(q, 2) and got[1] == greedy(p, len(got[1])) and len(got[1]) > 2
    assert P.unpack_u8(result.status).tolist()[1] == Finish.NONE   # its tokens stand
    assert 2 in P.unpack_i64(result.evicted_ids).tolist()          # and its KV is gone
    assert [t for s in streamed for t in s.get(2, (0, []))[1]] == greedy(q, 2)


def test_a_chained_row_whose_sequence_was_dropped_asks_for_its_ids(core, prompts):
    """The router took a sequence back (its lease expired) and the next lease both drops it
    and chains it: the worker answers NEED_IDS instead of failing."""
    p = list(prompts[1])
    first = core.start(make_lease({1: p}, full=[spec_of(1, p, len(p))]))
    chained = P.Lease(2, 2, 10.0, P.pack_i64([1]), P.pack_i32([P.CONTINUE]), P.pack_i32([P.CONTINUE]),
                      [], P.pack_i64([1]))
    second = core.start(chained, after=first)
    core.finish(first)
    result, _ = core.finish(second)
    assert P.unpack_u8(result.status).tolist() == [int(Finish.NEED_IDS)]


def test_a_step_padded_to_a_token_bucket_gives_the_unpadded_logits(model, prompts):
    """The layout the token-bucket CUDA graphs replay, run eagerly here: the step's tokens,
    then padding tokens that write nothing, and its rows, then rows of no tokens, for a
    decode batch with a new prompt among it. Each real row's logits and the KV written
    equal those of the unpadded step."""
    engine = Engine(model, runner="fast", max_num_seqs=8, max_num_batched_tokens=256, max_kv_tokens=4096)
    runner = engine.runner
    assert runner.name == "fast" and not runner.token_graphs  # no graphs on the CPU
    engine.pool.kv.zero_()  # its blocks are not initialised: compare the KV on known ground
    running = prompts[:3]
    for i, p in enumerate(running):
        engine.step([StepRow(i, p, 0, 0)])
    new = prompts[-1]
    rows = [StepRow(i, [7 + i], len(p), 1) for i, p in enumerate(running)] + [StepRow(9, new, 0, 0)]
    engine.place(rows)
    batch = StepBatch.build(engine.pool, [r.seq_id for r in rows], [r.new_ids for r in rows],
                            [r.start for r in rows])
    bucket = next(t for t in runner.token_buckets if t >= batch.num_tokens)
    assert bucket > batch.num_tokens and batch.num_rows < runner.max_batch  # both padded
    with torch.inference_mode():
        before = engine.pool.kv.clone()
        plain = runner._forward(runner._inputs(batch), batch.num_tokens, batch.max_query_len, False).clone()
        after = engine.pool.kv.clone()
        engine.pool.kv.copy_(before)
        runner._alloc_static()
        runner._load_tokens(batch, bucket)
        runner._tokens_into(bucket)
    torch.testing.assert_close(runner.static_logits[:batch.num_rows], plain, rtol=1e-5, atol=1e-5)
    # the same KV written, and nothing by the padding tokens
    torch.testing.assert_close(engine.pool.kv, after, rtol=1e-5, atol=1e-5)
    assert not torch.equal(after, before)


def test_an_eager_step_padded_to_its_token_count_gives_the_unpadded_logits(model, prompts):
    """Eager steps with prompts are padded (on a GPU, where there are graphs) with tokens that
    belong to no row, and their logits rows to max_batch. Run here, each real row's logits and
    the KV written equal those of the unpadded step, and the padding writes nothing."""
    engine = Engine(model, runner="fast", max_num_seqs=8, max_num_batched_tokens=256, max_kv_tokens=4096)
    runner = engine.runner
    engine.pool.kv.zero_()
    running = prompts[:3]
    for i, p in enumerate(running):
        engine.step([StepRow(i, p, 0, 0)])
    rows = [StepRow(i, [7 + i], len(p), 1) for i, p in enumerate(running)] + [StepRow(9, prompts[-1], 0, 0)]
    engine.place(rows)
    batch = StepBatch.build(engine.pool, [r.seq_id for r in rows], [r.new_ids for r in rows],
                            [r.start for r in rows])
    num_tokens = batch.num_tokens + 37
    with torch.inference_mode():
        before = engine.pool.kv.clone()
        plain = runner._forward(runner._inputs(batch), batch.num_tokens, batch.max_query_len, False).clone()
        after = engine.pool.kv.clone()
        engine.pool.kv.copy_(before)
        x = runner._inputs(batch, num_tokens, runner.max_batch)
        assert x.ids.shape[0] == x.slots.shape[0] == num_tokens and x.last.shape[0] == runner.max_batch
        padded = runner._forward(x, num_tokens, batch.max_query_len, False)
    assert padded.shape[0] == runner.max_batch
    torch.testing.assert_close(padded[:batch.num_rows], plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.pool.kv, after, rtol=1e-5, atol=1e-5)


def test_eager_steps_are_padded_to_few_token_counts_within_the_budget():
    from qmigrate.engine.runners.graph import EAGER_TOKEN_STEP, eager_sizes, eager_tokens
    sizes = eager_sizes(4096, 16384)
    assert sizes == list(range(4096 + EAGER_TOKEN_STEP, 16384 + 1, EAGER_TOKEN_STEP))
    for t in range(4097, 16385, 97):  # every step past the last bucket lands on a size warmed up
        assert eager_tokens(t, 16384) in sizes and 0 <= eager_tokens(t, 16384) - t < EAGER_TOKEN_STEP
    assert eager_sizes(4096, 5000) == [4608, 5000] and eager_tokens(4700, 5000) == 5000
    assert eager_sizes(4096, 4096) == [] and eager_sizes(1024, 1024) == []
    assert eager_tokens(20000, 16384) == 20000  # past the budget: never cut


def test_warm_up_makes_up_ids_inside_a_small_vocabulary():
    """The warm-up's throwaway prompts (run on a GPU only; called directly here) must stay in
    the model's vocabulary: on the CPU an id past the embedding raises, on a GPU it is a
    device-side assert that kills the worker."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from qmigrate.engine import startup
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    engine = make_engine(small, kv_tokens=2048, max_len=128, runner="fast")
    assert engine.shape.vocab_size == 100
    with torch.inference_mode():
        startup.warm_up(engine)
    assert engine.pool.free_tokens == engine.pool.capacity_tokens   # every throwaway row released
    reference = small.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=3, do_sample=False,
                               pad_token_id=0)[0, 3:].tolist()
    assert drive_one(engine, [1, 5, 7], 3) == reference
    assert all(0 <= i < 100 for n in (1, 17, 96, 600) for i in startup.made_up_ids(n, 100))
    assert startup.made_up_ids(5, 8) == [0, 1, 2, 3, 4]


def drive_one(engine: Engine, prompt: list[int], n: int) -> list[int]:
    job = Job(1, prompt, n)
    drive(engine, [job])
    return job.out


def test_the_prefill_rate_is_timed_on_a_step_of_prompts_that_leaves_nothing_behind(model):
    from qmigrate.engine import startup
    engine = make_engine(model, enable_prefix_caching=False, prefill_chunk=64, max_num_batched_tokens=256)
    free = engine.pool.num_free_blocks
    assert startup.prefill_rate(engine, repeats=2) > 0
    assert engine.pool.num_free_blocks == free and not engine.pool.blocks
    # a pool without room for the step: not timed, and nothing left behind either
    small = make_engine(model, kv_tokens=128, enable_prefix_caching=False, prefill_chunk=64,
                        max_num_batched_tokens=1024)   # a pool of 256 tokens (max_len), a step of 1,024
    free = small.pool.num_free_blocks
    assert startup.prefill_rate(small) == 0
    assert small.pool.num_free_blocks == free and not small.pool.blocks
