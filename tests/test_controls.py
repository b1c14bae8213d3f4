"""Sampling controls (engine/controls.py) against transformers' logits processors on the same
logits, in a worker's steps against generate() with the same processors, and the same
tokens after the sequence moves to another worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList,
                                                    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from qmigrate.engine.controls import Controls, ControlTable
from qmigrate.engine.sampling import SamplingRows, sample
from qmigrate.hub.builders import build_tiny_model
from qmigrate.hub.loading import load_model
from qmigrate.wire import protocol as P
from qmigrate.worker.core import WorkerCore

V = 64


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties, written from its definition: counts of the
    generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        for row, ids in enumerate(input_ids[:, self.prompt_len:]):
            for t in ids.tolist():
                counts[row, t] += 1
        return scores - counts * self.frequency - (counts > 0).float() * self.presence


def reference(controls: Controls, ids: list[int], prompt_len: int) -> LogitsProcessorList:
    """transformers' processors for `controls`, in the order controls.py applies them."""
    out = LogitsProcessorList()
    if controls.min_tokens:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, controls.min_tokens, list(controls.stop_token_ids)))
    if controls.bias_ids:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in zip(controls.bias_ids, controls.bias_values)]))
    if controls.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(controls.repetition_penalty))
    if controls.presence_penalty or controls.frequency_penalty:
        out.append(OpenAIPenalties(prompt_len, controls.presence_penalty, controls.frequency_penalty))
    return out


CASES = [Controls(repetition_penalty=1.7), Controls(presence_penalty=0.7, frequency_penalty=-0.4),
         Controls(bias_ids=(3, 9, 60), bias_values=(5.0, -100.0, 2.5)),
         Controls(min_tokens=6, stop_token_ids=(2, 7)),
         Controls(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0, bias_ids=(5,),
                  bias_values=(1.5,), min_tokens=9, stop_token_ids=(11,))]


def test_controls_change_the_logits_exactly_as_transformers_processors_do():
    gen = torch.Generator().manual_seed(3)
    table = ControlTable(V, 40, "cpu")
    seqs = []  # (seq_id, ids so far, prompt_len, controls); row 0 of every step has no controls
    for sid, controls in enumerate(CASES, start=1):
        ids = torch.randint(0, V, (int(torch.randint(8, 30, (1,), generator=gen)),), generator=gen).tolist()
        prompt_len = len(ids) // 2
        table.set(sid, controls, np.asarray(ids), prompt_len)
        seqs.append((sid, ids, prompt_len, controls))
    logits = torch.randn(len(seqs) + 1, V, generator=gen) * 4
    seq_ids = [99] + [s[0] for s in seqs]
    index = np.array([0] + [len(ids) - p for _, ids, p, _ in seqs])
    step = table.step(seq_ids, index)
    got = step.apply(logits, table.slab)
    assert torch.equal(got[0], logits[0])
    for row, (_, ids, prompt_len, controls) in enumerate(seqs, start=1):
        want = reference(controls, ids, prompt_len)(torch.tensor([ids]), logits[row:row + 1].clone())[0]
        assert torch.equal(got[row], want), (controls, got[row] - want)
    # the greedy token of each row is the reference's argmax; a sampled step records it by position
    rows = SamplingRows.build([0.0] * len(seq_ids), [1.0] * len(seq_ids), [0] * len(seq_ids),
                              [0] * len(seq_ids), index, "cpu")
    tokens = sample(logits, rows, step, table.slab)
    assert tokens.tolist() == got.argmax(-1).tolist()
    table.record(step, tokens)
    for row, (sid, ids, _, _) in enumerate(seqs, start=1):
        assert table.slab[table.slot_of[sid], len(ids)].item() == tokens[row].item()


def test_min_p_drops_what_transformers_min_p_warper_drops():
    gen = torch.Generator().manual_seed(4)
    table = ControlTable(V, 16, "cpu")
    table.set(1, Controls(min_p=0.2), np.array([1, 2, 3]), 2)
    table.set(2, Controls(min_p=0.05), np.array([1, 2, 3]), 2)
    x = torch.randn(3, V, generator=gen) * 3 / 0.7   # after a temperature of 0.7
    step = table.step([1, 5, 2], np.array([1, 0, 1]))
    got = step.filter_min_p(x)
    assert torch.equal(got[1], x[1])
    for row, min_p in ((0, 0.2), (2, 0.05)):
        want = MinPLogitsWarper(min_p)(None, x[row:row + 1].clone())[0]
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want)) and torch.equal(got[row], want)


def test_a_step_of_rows_without_controls_pays_nothing():
    table = ControlTable(V, 16, "cpu")
    assert not table and table.step([1, 2], np.array([0, 0])) is None
    table.set(1, Controls(), np.array([1, 2]), 1)   # neutral values: not held at all
    assert not table
    table.set(2, Controls(presence_penalty=0.5), np.array([1, 2]), 1)
    assert table and table.step([1, 3], np.array([0, 0])) is None
    step = table.step([1, 2, 3], np.array([0, 1, 0]))
    assert step.rows.tolist() == [1] and step.bias is None and step.early_stops is None and step.min_p is None
    table.forget(2)
    assert not table
    # ids past the model's logits (the tokenizer may count more) are dropped, never indexed
    table.set(3, Controls(bias_ids=(5, V + 3), bias_values=(1.0, 2.0), min_tokens=2, stop_token_ids=(V,)),
              np.array([1, 2]), 1)
    assert table.controls[table.slot_of[3]] == Controls(bias_ids=(5,), bias_values=(1.0,), min_tokens=2)
    table.step([3], np.array([0])).apply(torch.zeros(1, V), table.slab)


# --- in a worker's steps ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_model(tmp_path_factory.mktemp("controls-model") / "tiny"), "cpu")[0]


def make_core(model) -> WorkerCore:
    from qmigrate.engine.engine import Engine
    return WorkerCore(Engine(model, max_model_len=128, max_kv_tokens=1024, runner="hf"))


def lease_of(lease_id: int, ids: list[int], spec: P.SeqSpec | None, num_steps: int) -> P.Lease:
    return P.Lease(lease_id, lease_id, 10.0, P.pack_i64([1]), P.pack_i32([len(ids)]), P.pack_i32([ids[-1]]),
                   [spec] if spec is not None else [], b"", num_steps)


def generated(core: WorkerCore, lease: P.Lease) -> tuple[list[int], bool]:
    result, _ = core.run(lease)
    return P.unpack_i32(result.tokens).tolist(), P.Finish(P.unpack_u8(result.status)[0]).is_finished


@pytest.mark.parametrize("migrate_at", [None, 5])
def test_penalized_greedy_steps_equal_generate_with_the_same_processors_and_survive_a_migration(model, migrate_at):
    """Multi-step leases (each step fed the last token on the device) on one worker, or the
    sequence moved to a fresh worker after 5 tokens with only the ids that travel: the same
    tokens as generate() with transformers' processors."""
    prompt = [1, 17, 99, 5, 42, 17, 250, 7, 99, 3]
    num_new, eos = 14, [13]
    controls = dict(presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.4,
                    bias_ids=[300, 17], bias_values=[4.0, -3.0])
    processors = reference(Controls(0.6, 0.9, 1.4, 0.0, 4, tuple(eos), (300, 17), (4.0, -3.0)), prompt, len(prompt))
    config = GenerationConfig(max_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids_t = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), generation_config=config,
                              logits_processor=processors)[0, len(prompt):].tolist()
    plain = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), generation_config=config)[0, len(prompt):]
    assert want != plain.tolist()   # the controls change this output
    if eos[0] in want[4:]:   # the worker ends at EOS once min_tokens are out
        want = want[:want.index(eos[0], 4) + 1]

    spec = lambda ids: P.SeqSpec(1, P.pack_i32(ids), len(prompt), num_new, eos_ids=eos, min_new_tokens=4,
                                 **controls)
    core = make_core(model)
    ids = list(prompt)
    new, done = generated(core, lease_of(1, ids, spec(ids), migrate_at or 4))
    ids += new
    if migrate_at:   # a fresh worker, with the sequence's ids as the router holds them
        core = make_core(model)
        new, done = generated(core, lease_of(10, ids, spec(ids), 3))
        ids += new
    while not done:
        new, done = generated(core, lease_of(len(ids), ids, None, 3))
        ids += new
    assert ids[len(prompt):] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_controls_on_the_gpu_give_the_cpus_logits_and_tokens():
    """The same rows on CUDA: the controlled logits equal the CPU's, the greedy tokens too,
    and rows without controls are untouched."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(CASES) + 1, V, generator=gen) * 4
    out = {}
    for device in ("cpu", "cuda"):
        table = ControlTable(V, 40, device)
        for sid, controls in enumerate(CASES, start=1):
            table.set(sid, controls, np.arange(sid, sid + 20) % V, 8)
        step = table.step([99] + list(range(1, len(CASES) + 1)), np.array([0] + [12] * len(CASES)))
        out[device] = step.apply(logits.to(device), table.slab).cpu()
    assert torch.allclose(out["cpu"], out["cuda"], atol=1e-5) and torch.equal(out["cuda"][0], logits[0])
    assert out["cpu"].argmax(-1).tolist() == out["cuda"].argmax(-1).tolist()
