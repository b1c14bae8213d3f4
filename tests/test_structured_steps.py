"""Constrained rows in pipelined steps (engine/sit_out.py): beside plain rows, a constrained
row whose last token is still on the device sits the step out and comes back in the next, so
no step waits for the host's grammar work; plain rows keep every step and sample what they
sample without constrained rows, and constrained rows what they sample alone, on one worker,
across chained leases and after a move (recompute and KV transfer). A step of constrained rows
only waits for its masks, as before.

The fast runner, eager on the CPU, feeds each step's tokens on the device as on a GPU; the
`gpu` variants run it on one, with its CUDA graphs, pinned copies and events."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
jsonschema = pytest.importorskip("jsonschema")   # the test extra

from qmigrate.engine.rows import StepRow
from qmigrate.hub import grammars
from qmigrate.wire import protocol as P
from qmigrate.worker.core import WorkerCore
from test_structured import RESPONSE_FORMAT, SCHEMA, _compiled, _parse, tiny  # noqa: F401 (fixture)

PLAIN, CONSTRAINED = (1, 2), (3, 4)
PROMPTS = {1: [1, 40, 41, 42], 2: [1, 17, 99, 5], 3: [1, 7, 7, 300, 12], 4: [1, 250, 7, 42, 17, 9]}
SAMPLING = {1: (0.0, 0), 2: (1.0, 11), 3: (0.0, 0), 4: (0.8, 12)}   # (temperature, seed): greedy and seeded
MAX_NEW = {1: 40, 2: 40, 3: 120, 4: 120}
LOGPROBS = {1: 2, 4: 3}   # rows that ask for their tokens' logprobs, with this many alternatives
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
_MODELS: dict[str, object] = {}


def _model(tiny, device: str):
    """The tiny model on `device` (float32 on a GPU)."""
    if device == "cpu":
        return tiny[1]
    if device not in _MODELS:
        from qmigrate.hub.loading import load_model
        _MODELS[device] = load_model(tiny[0], "cuda:0", "float32")[0]
    return _MODELS[device]


def _engine(tiny, constrained=CONSTRAINED, device="cpu"):
    from qmigrate.engine.engine import Engine
    _, _, tokenizer, eos_ids = tiny
    model = _model(tiny, device)
    e = Engine(model, max_model_len=256, max_kv_tokens=4096, runner="fast", enforce_eager=device == "cpu")
    e.grammars.compiler = grammars.Compiler(lambda: tokenizer, model.config.vocab_size, 60.0)
    grammar = _parse(tiny, response_format=RESPONSE_FORMAT).grammar
    for sid in constrained:
        assert e.set_grammar(sid, e.grammars.matcher(grammar, eos_ids), eos_ids, [])
    return e


def _row(sid, new_ids, start, index):
    return StepRow(sid, new_ids, start, index, SAMPLING[sid][0], seed=SAMPLING[sid][1],
                   num_logprobs=LOGPROBS.get(sid, -1))


def _take(e, pending, out, lps, eos_ids) -> None:
    """A collected step's tokens (and asking rows' logprobs) into `out` (`lps`), but for rows
    that sampled nothing and steps past a row's end (in flight when it ended)."""
    asked, _ = e.take_logprobs(pending)
    for r, t in zip(pending.rows, e.collect(pending)):
        s = r.seq_id
        if s not in pending.unsampled and not _done(s, out[s], eos_ids):
            assert r.index == len(out[s])
            out[s].append(t)
            if s in LOGPROBS:
                values, ids, k = asked[s]
                width = LOGPROBS[s]   # a step's arrays are as wide as its widest ask
                lps[s].append((values[k, :1 + width].copy(), ids[k, :width].copy()))


def _done(sid, out, eos_ids) -> bool:
    return len(out) >= MAX_NEW[sid] or (sid in CONSTRAINED and bool(out) and out[-1] in eos_ids)


_ALONE: dict[tuple, tuple] = {}   # (sids, constrained, device) -> tokens and logprobs: the same for every test


def _one_by_one(tiny, sids, constrained, device="cpu") -> tuple[dict, dict]:
    """Each step collected before the next is launched: nothing is fed on the device."""
    if (sids, constrained, device) not in _ALONE:
        _ALONE[sids, constrained, device] = _stepped(tiny, sids, constrained, device)
    return _ALONE[sids, constrained, device]


def _stepped(tiny, sids, constrained, device) -> tuple[dict, dict]:
    e, eos_ids = _engine(tiny, constrained, device), tiny[3]
    out, lps = {sid: [] for sid in sids}, {sid: [] for sid in sids}
    while live := [s for s in sids if not _done(s, out[s], eos_ids)]:
        rows = [_row(s, PROMPTS[s] + out[s] if not out[s] else out[s][-1:],
                     0 if not out[s] else len(PROMPTS[s]) + len(out[s]) - 1, len(out[s])) for s in live]
        _take(e, e.launch(rows), out, lps, eos_ids)
    return out, lps


def _pipelined(tiny, sids, constrained, device="cpu"):
    """Each step launched before the one before is collected, as a worker does: a row goes on
    fed from the device, and a row that sat a step out goes to the next as it was. The tokens,
    the logprobs, and per launched step (placed sequences, those that sat out, whether its
    sampling waits, whether it was built the array way)."""
    e, eos_ids = _engine(tiny, constrained, device), tiny[3]
    out, lps, launched = {sid: [] for sid in sids}, {sid: [] for sid in sids}, []
    pending = e.launch([_row(s, PROMPTS[s], 0, 0) for s in sids])
    while pending is not None:
        rows = []
        for r in pending.rows:
            s = r.seq_id
            if _done(s, out[s], eos_ids):   # ended at a step collected already
                continue
            if s in pending.sat_out:
                rows.append(r)
            elif s in pending.row_of and r.index + 1 < MAX_NEW[s]:
                rows.append(_row(s, [], r.start + (len(r.new_ids) or 1), r.index + 1))
        arrayed = e.num_continued
        nxt = e.launch(rows, after=pending) if rows else None
        if nxt is not None:
            launched.append((set(nxt.row_of), set(nxt.sat_out), nxt.logits is not None, e.num_continued > arrayed))
        _take(e, pending, out, lps, eos_ids)
        pending = nxt
    return out, lps, launched


def _check_document(tiny, tokens):
    document = json.loads(tiny[2].decode(tokens, skip_special_tokens=True))
    jsonschema.validate(document, SCHEMA)


@pytest.mark.parametrize("device", DEVICES)
def test_constrained_rows_sit_out_every_other_pipelined_step_and_sample_as_alone(tiny, device):
    plain_alone, plain_lps, _ = _pipelined(tiny, PLAIN, (), device)
    constrained_alone, constrained_lps = _one_by_one(tiny, CONSTRAINED, CONSTRAINED, device)
    got, lps, launched = _pipelined(tiny, PLAIN + CONSTRAINED, CONSTRAINED, device)
    for sid in PLAIN:
        assert got[sid] == plain_alone[sid], sid
    for sid in CONSTRAINED:
        assert got[sid] == constrained_alone[sid], sid
        assert got[sid][-1] in tiny[3]
        _check_document(tiny, got[sid])
    # logprobs too (of the masked logits), up to the float sums of another batch
    for sid, alone in ((1, plain_lps[1]), (4, constrained_lps[4])):
        assert len(lps[sid]) == len(got[sid]) == len(alone)
        for (values, ids), (values_alone, ids_alone) in zip(lps[sid], alone):
            assert (ids == ids_alone).all() and np.allclose(values, values_alone, atol=1e-3), sid
    # while plain rows share the steps: they run in every one, built the array way (constrained
    # rows out, or back), the constrained rows in every other one, and no sampling waits
    shared = [step for step in launched if set(PLAIN) <= step[0]]
    assert len(shared) == MAX_NEW[1] - 1
    assert all(arrayed and not waits for _, _, waits, arrayed in shared)
    for sid in CONSTRAINED:
        pattern = [sid in placed for placed, sat, _, _ in shared if sid in placed or sid in sat]
        assert len(pattern) >= 8 and pattern == [i % 2 == 1 for i in range(len(pattern))], (sid, pattern)


def test_a_step_of_constrained_rows_only_still_samples_once_the_step_before_is_collected(tiny):
    """Nothing to gain without a plain row: no row sits out, and every pipelined step's sampling
    waits for the masks that collecting the step before fills; the tokens are those of the
    rows run one collected step at a time."""
    alone, _ = _one_by_one(tiny, CONSTRAINED, CONSTRAINED)
    got, _, launched = _pipelined(tiny, CONSTRAINED, CONSTRAINED)
    assert got == alone
    assert launched and all(waits and not sat for _, sat, waits, _ in launched)
    for sid in CONSTRAINED:
        assert re.fullmatch(r"\{.*\}", tiny[2].decode(got[sid], skip_special_tokens=True), re.S)


# --- a worker: chained leases and a move ---------------------------------------------------------

def _spec(tiny, sid, ids, **kw):
    grammar = _parse(tiny, response_format=RESPONSE_FORMAT).grammar if sid in CONSTRAINED else ""
    temperature, seed = SAMPLING[sid]
    return P.SeqSpec(sid, P.pack_i32(ids), len(PROMPTS[sid]), MAX_NEW[sid], temperature=temperature, seed=seed,
                     eos_ids=tiny[3] if sid in CONSTRAINED else [], grammar=grammar,
                     num_logprobs=LOGPROBS.get(sid, -1), **kw)


def _lease(lease_id, sids, lengths, last, specs, num_steps):
    return P.Lease(lease_id, lease_id, 30.0, P.pack_i64(list(sids)), P.pack_i32(lengths), P.pack_i32(last),
                   specs, b"", num_steps)


def _taken(result, out, ended) -> dict[int, int]:
    """Add a lease's tokens to `out` (as the router does: nothing after a row's end); its counts."""
    counts = dict(zip(P.unpack_i64(result.seq_ids).tolist(), P.unpack_i32(result.counts).tolist()))
    tokens = iter(P.unpack_i32(result.tokens).tolist())
    for (sid, n), code in zip(counts.items(), P.unpack_u8(result.status).tolist()):
        got = [next(tokens) for _ in range(n)]
        if sid not in ended:
            out[sid] += got
            if P.Finish(code).is_finished:
                ended.add(sid)
    return counts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("move", [None, "recompute", "transfer"])
def test_sitting_out_holds_across_chained_leases_and_after_a_move(tiny, move, device):
    """Leases of 6, 3 and 2 steps, each chained behind the last step of the one before (and
    launched before that lease's step before it is collected): the constrained rows decode
    every other step, from one lease into the next, whether they sat out the last step of a
    lease (lease 1) or ran in it (lease 2). Then a lease runs every row to its end where they
    are, or on a fresh worker that only has what travels (and by transfer, the KV). Every
    row's tokens are those it has without the others: plain rows without constrained ones,
    constrained rows alone."""
    eos_ids = tiny[3]
    grammar = _parse(tiny, response_format=RESPONSE_FORMAT).grammar
    new_core = lambda: _compiled(WorkerCore(_engine(tiny, (), device)), grammar, eos_ids)
    plain, _ = _one_by_one(tiny, PLAIN, (), device)
    constrained, _ = _one_by_one(tiny, CONSTRAINED, CONSTRAINED, device)
    sids = PLAIN + CONSTRAINED
    core, out, ended = new_core(), {sid: [] for sid in sids}, set()
    run = core.start(_lease(1, sids, [len(PROMPTS[s]) for s in sids], [PROMPTS[s][-1] for s in sids],
                            [_spec(tiny, s, PROMPTS[s]) for s in sids], 6))
    # constrained rows: in steps 1, 3, 5 of lease 1; 1 and 3 of lease 2; 2 of lease 3
    for lease_id, num_steps, counts in ((2, 3, (6, 3)), (3, 2, (3, 2)), (None, 0, (2, 1))):
        behind = []
        if lease_id is not None:
            chained = _lease(lease_id, sids, [P.CONTINUE] * 4, [P.CONTINUE] * 4, [], num_steps)
            launch = lambda: behind.append(core.start(chained, after=run))
        result, _ = core.finish(run, on_last_launch=launch if lease_id is not None else None)
        assert _taken(result, out, ended) == {1: counts[0], 2: counts[0], 3: counts[1], 4: counts[1]}
        if behind:
            assert [r.seq_id for r in behind[0].rows] == list(sids) and not any(r.new_ids for r in behind[0].rows)
            run = behind[0]
    ids = {s: PROMPTS[s] + out[s] for s in sids}
    if move is None:
        where, specs = core, []
    else:
        where, specs = new_core(), []
        for n, s in enumerate(sids):
            kw = {}
            if move == "transfer":
                where.receive_transfer(10 + n, s, core.engine.export_kv(s, len(ids[s]) - 1))
                kw = {"kv_from": "w1", "transfer_id": 10 + n}
            specs.append(_spec(tiny, s, ids[s], **kw))
    result, _ = where.run(_lease(4, sids, [len(ids[s]) for s in sids], [ids[s][-1] for s in sids], specs, 120))
    _taken(result, out, ended)
    if move == "transfer":
        assert where.num_kv_imported == len(sids)
    assert ended == set(sids)
    for sid in PLAIN:
        assert out[sid] == plain[sid], sid
    for sid in CONSTRAINED:
        assert out[sid] == constrained[sid], sid
        _check_document(tiny, out[sid])
