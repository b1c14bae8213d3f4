"""Chunked prefill across steps: a prompt longer than `prefill_tokens_per_step` fills its KV
over several steps that also carry the decode rows, and its first token comes from the step
of its last part. Greedy output must still equal `generate()` (CPU, fp32), with neighbours
decoding, through chained and multi-step leases, and when the sequence moves mid-prompt.
`prefill_tokens_with_decode` limits only steps that have decode rows: a step of prompts alone
takes them whole."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from qmigrate.config import ConfigError, WorkerConfig, local_topology, parse_topology, worker_settings
from qmigrate.engine.rows import StepRow, prompt_budget, share_prompt_budget
from qmigrate.engine.config import EngineConfig
from qmigrate.wire import protocol as P
from qmigrate.wire.protocol import Finish
from qmigrate.worker.core import WorkerCore
from conftest import greedy_tokens
from test_engine import greedy, make_engine, make_lease, model, prompts, run, spec_of, tiny  # noqa: F401

BUDGET = 8


def record_placed(engine) -> list[list[tuple[int, int, int]]]:
    """Spy on engine.place (every forward's rows go through it): (seq_id, start, new ids) per row."""
    calls, real = [], engine.place

    def place(rows, protect=()):
        calls.append([(r.seq_id, r.start, len(r.new_ids)) for r in rows])
        return real(rows, protect)
    engine.place = place
    return calls


def long_prompt(prompts, n: int) -> list[int]:
    out = []
    while len(out) < n:
        out += prompts[(len(out) // 7) % len(prompts)]
    return out[:n]


def test_the_budget_is_shared_in_row_order_and_decode_rows_do_not_count():
    rows = [StepRow(1, [5], 9, 1), StepRow(2, list(range(6)), 0, 0), StepRow(3, list(range(5)), 0, 0),
            StepRow(4, list(range(4)), 0, 0), StepRow(5, [7], 3, 2)]
    out, cut, deferred = share_prompt_budget(rows, BUDGET)
    assert [len(r.new_ids) for r in out] == [1, 6, 2, 4, 1]
    assert (cut, deferred) == ({2}, {3})
    assert share_prompt_budget(rows, 0) == (rows, set(), set())       # no limit
    assert share_prompt_budget(rows, 15) == (rows, set(), set())      # everything fits


def test_the_budget_while_decoding_holds_only_for_steps_with_decode_rows():
    decode, fed, prompt = StepRow(1, [5], 9, 1), StepRow(2, [], 9, 1), StepRow(3, list(range(40)), 0, 0)
    capped = EngineConfig(prefill_tokens_with_decode=16, max_num_batched_tokens=1000)
    assert prompt_budget([decode, prompt], capped) == 16
    assert prompt_budget([fed, prompt], capped) == 16          # a row fed on the device decodes too
    assert prompt_budget([prompt], capped) == 1000              # prompts alone: a step's tokens
    assert prompt_budget([prompt, StepRow(4, [7], 0, 0)], capped) == 1000   # a one-token prompt is no decode row
    both = EngineConfig(prefill_tokens_per_step=64, prefill_tokens_with_decode=16, max_num_batched_tokens=1000)
    assert (prompt_budget([decode, prompt], both), prompt_budget([prompt], both)) == (16, 64)
    assert prompt_budget([decode, prompt], dataclasses.replace(both, prefill_tokens_per_step=8)) == 8
    assert prompt_budget([decode, prompt], EngineConfig()) == prompt_budget([prompt], EngineConfig()) == 0


def test_a_backlog_of_prompts_raises_the_budget_so_it_is_spread_over_at_most_n_steps():
    decode = StepRow(1, [5], 9, 1)
    prompts = [StepRow(10 + i, list(range(100)), 0, 0) for i in range(5)]   # 500 tokens waiting
    spread = EngineConfig(prefill_tokens_with_decode=64, prefill_spread_steps=4, max_num_batched_tokens=1000)
    assert prompt_budget([decode, *prompts[:2]], spread) == 64                  # 200 / 4 < 64: the limit
    assert prompt_budget([decode, *prompts], spread) == 125                     # 500 / 4
    assert prompt_budget([decode, *prompts, StepRow(9, list(range(3)), 0, 0)], spread) == 126   # rounded up
    assert prompt_budget(prompts, spread) == 1000                               # no decode row: no limit
    fixed = dataclasses.replace(spread, prefill_spread_steps=0)
    assert prompt_budget([decode, *prompts], fixed) == 64
    # in a step: the budget goes to the prompts in row order, the rest waits for later steps
    rows, cut, deferred = share_prompt_budget([decode, *prompts], prompt_budget([decode, *prompts], spread))
    assert [len(r.new_ids) for r in rows] == [1, 100, 25, 100, 100, 100] and (cut, deferred) == ({2}, {3, 4, 5})


def test_the_worker_setting_reaches_the_engine_and_bad_values_are_refused():
    engine = WorkerConfig().engine_config()
    assert (engine.prefill_tokens_with_decode, engine.prefill_spread_steps) == (0, 4)
    settings = worker_settings(["prefill_tokens_with_decode=256"])
    assert WorkerConfig(**settings).engine_config().prefill_tokens_with_decode == 256
    data = yaml.safe_load(yaml.safe_dump(local_topology(1).to_dict()))     # as a YAML file gives it
    data["workers"][0]["prefill_tokens_with_decode"] = 0
    assert parse_topology(data).workers[0].engine_config().prefill_tokens_with_decode == 0
    for bad in ("-1", "lots"):
        with pytest.raises(ConfigError, match="prefill_tokens_with_decode"):
            worker_settings([f"prefill_tokens_with_decode={bad}"])


class Router:
    """The router's bookkeeping for one or more cores: full forms to a core that does not hold
    a sequence, diffs after that; a result's tokens appended, finished sequences forgotten."""

    def __init__(self, prompts: dict[int, list[int]], max_new_tokens: int):
        self.ids = {sid: list(p) for sid, p in prompts.items()}
        self.prompt_len = {sid: len(p) for sid, p in prompts.items()}
        self.max_new = max_new_tokens
        self.owner: dict[int, WorkerCore] = {}
        self.done: dict[int, list[int]] = {}     # finished: the generated tokens
        self.lease_no = 0

    def step(self, core: WorkerCore, sids, num_steps: int = 1, drop=()) -> dict[int, list[int]]:
        self.lease_no += 1
        here = {s: self.ids[s] for s in sids}
        full = [spec_of(s, self.ids[s], self.prompt_len[s], self.max_new) for s in sids if self.owner.get(s) is not core]
        ran = run(core, make_lease(here, full=full, lease_id=self.lease_no, num_steps=num_steps if not full else 1,
                                   drop_ids=list(drop)))
        for s in sids:
            assert ran.status[s] in (Finish.NONE, Finish.LENGTH), (s, ran.status[s])
            self.owner[s] = core
            self.ids[s] += ran.tokens[s]
            if ran.status[s].is_finished:
                self.done[s] = self.ids.pop(s)[self.prompt_len[s]:]
        return ran.tokens

    def run_all(self, core: WorkerCore, max_leases: int = 50) -> dict[int, int]:
        """Lease every live sequence to core until all finish; the lease of each one's first token."""
        first_at = {}
        for k in range(1, max_leases + 1):
            if not self.ids:
                return first_at
            for s, toks in self.step(core, list(self.ids)).items():
                if toks and s not in first_at:
                    first_at[s] = k
        raise AssertionError(f"unfinished after {max_leases} leases: {sorted(self.ids)}")


def test_long_prompts_spread_over_steps_beside_a_decoding_sequence(model, prompts, greedy):
    engine = make_engine(model, prefill_tokens_per_step=BUDGET)
    core, steps = WorkerCore(engine), record_placed(engine)
    ps = {1: list(prompts[0]), 2: long_prompt(prompts, 27), 3: long_prompt(prompts[1:], 13)}
    router = Router(ps, max_new_tokens=6)
    router.step(core, [1])                      # 1 is decoding before the others arrive
    first_at = router.run_all(core)
    for sid, p in ps.items():
        assert router.done[sid] == greedy(p, 6), sid
    # no step carries more than the budget of prompt tokens, and sequence 1 decodes in each
    assert all(sum(n for _, _, n in step if n > 1) <= BUDGET for step in steps[1:])
    assert all(any(s == 1 and n == 1 for s, _, n in step) for step in steps[1:6])
    # 27 + 13 prompt tokens at 8 a step: the first token of 2 comes in lease 4, of 3 in lease 5
    assert (first_at[2], first_at[3]) == (4, 5)
    assert core.filling == {}


def test_chained_and_multi_step_leases_feed_the_next_part(model, prompts, greedy):
    core = WorkerCore(make_engine(model, prefill_tokens_per_step=BUDGET))
    p, q = long_prompt(prompts, 30), list(prompts[3])
    first = core.start(make_lease({1: p, 2: q}, full=[spec_of(1, p, len(p)), spec_of(2, q, len(q))]))
    chained = P.Lease(2, 2, 10.0, P.pack_i64([1, 2]), P.pack_i32([P.CONTINUE] * 2),
                      P.pack_i32([P.CONTINUE] * 2), [], b"", 1)
    second = core.start(chained, after=first)
    got = {1: [], 2: []}
    for started in (first, second):
        result, _ = core.finish(started)
        counts = dict(zip(P.unpack_i64(result.seq_ids).tolist(), P.unpack_i32(result.counts).tolist()))
        assert counts[1] == 0                    # still filling: no token yet
        flat = P.unpack_i32(result.tokens).tolist()
        got[2] += flat[:counts[2]]
    assert 1 in core.filling and core.engine.cached_len(1) > 0
    # a multi-step lease of diffs: the remaining parts, then decode steps
    lease = make_lease({1: p, 2: q + got[2]}, lease_id=3, num_steps=8)
    ran = run(core, lease)
    assert ran.tokens[1] == greedy(p, len(ran.tokens[1])) and len(ran.tokens[1]) >= 4
    assert got[2] + ran.tokens[2] == greedy(q, len(got[2]) + len(ran.tokens[2]))
    assert ran.emitted[1][0] == 0               # the detokenizer sees token 0 first
    assert 1 not in core.filling


def test_a_sequence_moved_mid_prompt_is_recomputed_elsewhere(model, prompts, greedy):
    a, b = (WorkerCore(make_engine(model, prefill_tokens_per_step=BUDGET)) for _ in range(2))
    p = long_prompt(prompts, 35)
    router = Router({1: p, 2: list(prompts[2])}, max_new_tokens=5)
    router.step(a, [1, 2])
    router.step(a, [1, 2])
    assert 1 in a.filling and len(router.ids[1]) == len(p)       # partly filled, no token yet
    router.step(b, [1])                                            # moved: b gets the full form
    router.step(a, [2], drop=[1])                                  # and a frees it
    assert 1 not in a.filling and a.engine.cached_len(1) < 0
    router.run_all(b)
    assert router.done[1] == greedy(p, 5) and router.done[2] == greedy(prompts[2], 5)
    assert a.filling == b.filling == {}


@pytest.mark.parametrize("budget", [0, 5, 64])
def test_the_output_does_not_depend_on_the_budget(model, prompts, greedy, budget):
    core = WorkerCore(make_engine(model, prefill_tokens_per_step=budget))
    ps = {i: long_prompt(prompts[i:], 17 + 5 * i) for i in range(3)}
    router = Router(ps, max_new_tokens=4)
    router.run_all(core)
    for sid, p in ps.items():
        assert router.done[sid] == greedy(p, 4), sid


@pytest.mark.timeout(300)
def test_the_pipeline_with_a_small_budget_equals_generate_through_a_drain(tmp_path, ipc_dir, tiny_model_dir):
    """Real processes: prompts of up to 61 tokens at 16 prompt tokens a step on each worker (12
    in steps that also decode), while w1 is drained (its sequences move, some of them
    mid-prompt: a KV shipment of a prompt not all filled has nothing to send, and the
    receiver recomputes)."""
    from conftest import greedy_reference
    from test_pipeline import MAX_LEASE_STEPS, _prompts, _run_with_a_drain
    reference = greedy_reference(tiny_model_dir)
    prompts = [p for p in _prompts(16, seed=7)
               if len(greedy_tokens(tiny_model_dir, p["prompt_ids"], p["max_new_tokens"])) > MAX_LEASE_STEPS]
    assert sum(len(p["prompt_ids"]) > 32 for p in prompts) >= 4
    finals, moves = _run_with_a_drain(tmp_path, ipc_dir, tiny_model_dir, 2, prompts,
                                      worker={"prefill_tokens_per_step": 16, "prefill_tokens_with_decode": 12},
                                      migration="transfer")
    for p in prompts:
        reference(p["prompt_ids"], p["max_new_tokens"], finals[p["id"]]["token_ids"], p["id"])
    assert moves.get("drain", 0) > 0, moves


def test_a_prompt_on_a_cached_prefix_reports_its_cached_positions_with_its_first_token(model, prompts):
    core = WorkerCore(make_engine(model, prefill_tokens_per_step=BUDGET))
    p = long_prompt(prompts, 40)
    Router({1: p}, max_new_tokens=2).run_all(core)        # its first 32 positions are now cached
    q = p[:32] + long_prompt(prompts[2:], 13)
    ids, reported = {2: list(q)}, []
    for k in range(1, 5):
        full = [spec_of(2, q, len(q), 4)] if k == 1 else []
        result, tokens = core.run(make_lease(ids, full=full, lease_id=10 + k))
        counts = P.unpack_i32(result.counts).tolist()
        shown = P.unpack_i32(tokens.cached_tokens).tolist() if tokens.cached_tokens else []
        reported.append((counts[0], P.unpack_i32(result.cached_tokens).tolist()[0], shown))
        ids[2] += P.unpack_i32(result.tokens).tolist()
    # 13 positions left at 8 a step: no token in the first lease, then the first with 32 cached
    assert reported[:2] == [(0, -1, []), (1, 32, [32])]
    assert [r[1] for r in reported[2:]] == [-1, -1]


def test_prompts_beside_decode_rows_take_the_decode_budget_and_alone_go_whole(model, prompts, greedy):
    engine = make_engine(model, prefill_tokens_with_decode=BUDGET, prefill_spread_steps=0)
    core, steps = WorkerCore(engine), record_placed(engine)
    ps = {1: list(prompts[0]), 2: long_prompt(prompts[2:], 30), 3: long_prompt(prompts, 45),
          4: long_prompt(prompts[1:], 13)}
    router = Router(ps, max_new_tokens=12)
    router.step(core, [1, 2])                  # no decode rows yet: both prompts in one step
    assert sorted(steps[0]) == [(1, 0, len(ps[1])), (2, 0, 30)]
    first_at = router.run_all(core)
    for sid, p in ps.items():
        assert router.done[sid] == greedy(p, 12), sid
    # while 1 and 2 decode (every step), 3 and 4 share BUDGET prompt tokens a step, 3 first:
    # 45 + 13 tokens at 8 a step, so neither waits behind the other for long
    assert all(sum(n for _, _, n in step if n > 1) <= BUDGET for step in steps[1:9])
    assert all({(s, n) for s, _, n in step} >= {(1, 1), (2, 1)} for step in steps[1:9])
    assert (first_at[3], first_at[4]) == (6, 8)
    assert core.filling == {}


def test_a_multi_step_lease_feeds_the_next_parts_beside_its_decode_rows(model, prompts, greedy):
    engine = make_engine(model, prefill_tokens_with_decode=BUDGET, prefill_spread_steps=0)
    core, steps = WorkerCore(engine), record_placed(engine)
    p = long_prompt(prompts[1:], 33)
    router = Router({1: list(prompts[3]), 2: p}, max_new_tokens=10)
    router.step(core, [1])
    router.step(core, [1, 2])                  # 2 arrives beside a decode row: 8 of its 33
    assert 2 in core.filling
    tokens = router.step(core, [1, 2], num_steps=6)   # the rest in 4 steps, its first token in the 4th
    assert len(tokens[2]) == 3 and len(tokens[1]) == 6
    assert all(sum(n for _, _, n in step if n > 1) <= BUDGET for step in steps[1:])
    router.run_all(core)
    assert router.done[1] == greedy(prompts[3], 10) and router.done[2] == greedy(p, 10)


def test_the_admission_bench_times_every_step_of_a_prompt_under_the_limit(tiny_model_dir, capsys, tmp_path):
    from qmigrate.bench.admission import run_admission_steps
    (x,) = run_admission_steps(str(tiny_model_dir), "cpu", [3], 16, 40,
                               {"prefill_tokens_with_decode": 8, "prefill_spread_steps": 0, "runner": "hf"}, tmp_path / "out.json")
    assert (x["batch"], x["limit"], x["limited_steps"]) == (3, 8, 5)    # 40 tokens at 8 a step
    assert min(x["decode_ms"], x["whole_ms"], x["limited_max_ms"]) > 0
    assert "prefill_tokens_with_decode=8" in capsys.readouterr().out
    assert (tmp_path / "out.json").exists()
    with pytest.raises(ValueError, match="positions"):
        run_admission_steps(str(tiny_model_dir), "cpu", [3], 16, 4000, {})


def test_bench_admission_step_runs_the_admission_bench(tiny_model_dir, tmp_path):
    import json
    from typer.testing import CliRunner
    from qmigrate.cli import app
    out = tmp_path / "admission.json"
    result = CliRunner().invoke(app, ["bench", "admission-step", "--model", str(tiny_model_dir), "--batches", "3",
                                      "--context", "16", "--admit-tokens", "40", "--runner", "hf", "--json", str(out),
                                      "--worker-setting", "prefill_tokens_with_decode=8",
                                      "--worker-setting", "prefill_spread_steps=0"])
    assert result.exit_code == 0, result.output
    (x,) = json.loads(out.read_text())["results"]
    assert (x["batch"], x["limit"], x["limited_steps"]) == (3, 8, 5)


def test_the_in_process_bench_spreads_prompts_beside_decode_rows_and_stays_exact(model, prompts, greedy):
    """The bench's in-process path is the offline API's loop (qmigrate.LLM)."""
    from qmigrate.offline.llm import LLM
    from qmigrate.offline.params import SamplingParams
    engine = make_engine(model, prefill_tokens_with_decode=BUDGET, prefill_spread_steps=0, max_num_seqs=8,
                         max_num_batched_tokens=48)
    steps, got, seen, real = record_placed(engine), {}, {}, engine.collect   # seen keeps ids unique

    def collect(pending):
        tokens = real(pending)
        if id(pending) not in seen:
            seen[id(pending)] = pending
            for r, t in zip(pending.rows, tokens):
                if r.seq_id not in pending.partial:
                    got.setdefault(r.seq_id, []).append(t)
        return tokens
    engine.collect = collect
    requests = [(long_prompt(prompts[i:], 20 + 3 * i), 5) for i in range(5)]
    outs = LLM.from_engine(engine).generate([p for p, _ in requests],
                                            SamplingParams(max_tokens=5, ignore_eos=True, detokenize=False))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 25
    assert got == {i: greedy(p, 5) for i, (p, _) in enumerate(requests)}
    assert [o.outputs[0].token_ids for o in outs] == [greedy(p, 5) for p, _ in requests]
    # the first step takes 2 prompts whole (43 tokens); the others come 8 tokens a step
    assert sum(n for _, _, n in steps[0]) == 43
    assert all(sum(n for _, _, n in step if n > 1) <= BUDGET for step in steps[1:])


def test_prompts_held_back_join_a_step_without_decode_rows_up_to_its_token_budget(model, prompts, greedy):
    engine = make_engine(model, prefill_tokens_with_decode=BUDGET, prefill_spread_steps=0,
                         max_num_batched_tokens=32)
    core, steps = WorkerCore(engine), record_placed(engine)
    ps = {1: list(prompts[0]), 2: long_prompt(prompts[2:], 30), 3: long_prompt(prompts, 35)}
    router = Router(ps, max_new_tokens=3)
    router.step(core, [1])
    router.run_all(core)
    for sid, p in ps.items():
        assert router.done[sid] == greedy(p, 3), sid
    # 1 decodes in leases 1-2 (2 gets 8 + 8), then the held-back rest of 2 and 3 run 32 together
    prompt_tokens = [sum(n for _, _, n in step if n > 1) for step in steps[1:]]
    assert prompt_tokens[:4] == [BUDGET, BUDGET, 32, BUDGET] and max(prompt_tokens) == 32


def test_the_prompt_limits_change_between_steps_only_through_the_engine(model):
    """What the admission benchmark times one prompt under: the limit of the next step, set by
    Engine.set_prompt_limits, which takes the prompt limits and nothing else."""
    engine = make_engine(model, prefill_tokens_with_decode=BUDGET, prefill_spread_steps=0)
    rows = [StepRow(1, [5], 9, 1), StepRow(2, list(range(40)), 0, 0)]
    assert prompt_budget(rows, engine.config) == BUDGET
    engine.set_prompt_limits(prefill_tokens_with_decode=0)
    assert prompt_budget(rows, engine.config) == 0 and engine.config.max_num_seqs == make_engine(model).config.max_num_seqs
    engine.set_prompt_limits(prefill_tokens_with_decode=16, prefill_spread_steps=0)
    assert prompt_budget(rows, engine.config) == 16
    with pytest.raises(ValueError, match="'max_num_seqs' is not a prompt limit"):
        engine.set_prompt_limits(max_num_seqs=4)
    with pytest.raises(ValueError, match="prefill_tokens_with_decode must be an integer >= 0"):
        engine.set_prompt_limits(prefill_tokens_with_decode=-1)
    assert prompt_budget(rows, engine.config) == 16
