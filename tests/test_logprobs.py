"""Logprobs: a generated token's (after the sampling controls and temperature) and a prompt's,
equal to transformers' log-softmax of the same logits within 1e-4 on the CPU in fp32, on one
worker and after a forced migration (by recompute and by KV transfer); then through the official
`openai` client against a live node, streamed and not, in OpenAI's shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qmigrate.engine.engine import Engine
from qmigrate.hub.builders import build_tiny_model
from qmigrate.hub.loading import load_model
from qmigrate.wire import codec
from qmigrate.wire import protocol as P
from qmigrate.worker.core import WorkerCore

TOL = 1e-4
PROMPT = [1, 17, 99, 5, 42, 17, 250, 7, 99, 3, 64, 12]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_tiny_model(tmp_path_factory.mktemp("lp-model") / "tiny"), "cpu")[0]


def make_core(model, **settings) -> WorkerCore:
    return WorkerCore(Engine(model, max_model_len=128, max_kv_tokens=2048, runner="hf", **settings))


def spec_of(ids, **kw) -> P.SeqSpec:
    return P.SeqSpec(1, P.pack_i32(ids), len(PROMPT), 10, **kw)


def lease_of(lease_id: int, ids: list[int], spec, num_steps: int) -> P.Lease:
    return P.Lease(lease_id, lease_id, 10.0, P.pack_i64([1]), P.pack_i32([len(ids)]), P.pack_i32([ids[-1]]),
                   [spec] if spec is not None else [], b"", num_steps)


def run(core, lease):
    """(tokens, [(values, top ids)] per token, prompt entries or None) of a lease, through the wire."""
    result, tokens = core.run(lease)
    msg = codec.decode(codec.encode(tokens))
    n = len(msg.tokens) // 4
    rows = list(zip(*P.unpack_logprob_block(msg.lp_values, msg.lp_top_ids, n, msg.lp_width, 1))) \
        if msg.lp_width >= 0 else []
    prompt = None
    if msg.prompt_width >= 0:
        count = int(P.unpack_i32(msg.prompt_counts).sum())
        prompt = list(zip(*P.unpack_logprob_block(msg.prompt_values, msg.prompt_top_ids, count, msg.prompt_width, 2)))
    return P.unpack_i32(result.tokens).tolist(), rows, prompt


def reference(model, ids: list[int], temperature: float, bias: dict | None = None) -> torch.Tensor:
    """transformers' log-softmax at every position of ids (logits / T, after a logit bias)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    for t, b in (bias or {}).items():
        logits[:, t] += b
    return (logits / (temperature or 1.0)).log_softmax(-1)


def check(model, ids, made, rows, temperature, width, bias=None):
    want = reference(model, ids, temperature, bias)
    for i, (token, (values, top)) in enumerate(zip(made, rows)):
        at = want[len(ids) - len(made) - 1 + i]
        assert abs(values[0] - float(at[token])) < TOL, f"token {i}"
        best = at.topk(width)
        assert np.allclose(values[1:1 + width], best.values.numpy(), atol=TOL), f"top of token {i}"
        assert set(top[:width].tolist()) == set(best.indices.tolist()) or width == 0


@pytest.mark.parametrize("move", [None, "recompute", "transfer"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_token_logprobs_equal_transformers_and_survive_a_migration(model, move, temperature):
    """Multi-step leases, the sequence then moved to a fresh worker with only what travels (its
    ids, or its ids and shipped KV): every token's logprob and top 5 equal transformers'."""
    kw = dict(temperature=temperature, seed=11, num_logprobs=5, bias_ids=[300], bias_values=[2.5])
    core, ids, made, rows = make_core(model), list(PROMPT), [], []
    new, lps, _ = run(core, lease_of(1, ids, spec_of(ids, **kw), 4))
    ids, made, rows = ids + new, made + new, rows + lps
    if move is not None:
        fresh = make_core(model)
        spec = spec_of(ids, **kw)
        if move == "transfer":
            kv = core.export(1, len(ids) - 1)
            fresh.receive_transfer(7, 1, kv)
            spec = spec_of(ids, kv_from="tcp://old", transfer_id=7, **kw)
        core = fresh
        new, lps, _ = run(core, lease_of(2, ids, spec, 3))
        assert move != "transfer" or core.num_kv_imported == 1
        ids, made, rows = ids + new, made + new, rows + lps
    while len(made) < 10:
        new, lps, _ = run(core, lease_of(len(ids), ids, None, 3))
        ids, made, rows = ids + new, made + new, rows + lps
    assert len(made) == len(rows) == 10
    check(model, ids, made, rows, temperature, 5, {300: 2.5})


@pytest.mark.parametrize("settings", [{}, {"prefill_chunk": 5, "enable_prefix_caching": True}])
def test_prompt_logprobs_equal_transformers_in_chunks_and_past_a_cached_prefix(model, settings):
    """Every prompt position's logprob, rank and top 3, also when the prompt runs in chunks and
    when the same prompt's blocks are cached already (the request computes them anyway)."""
    core = make_core(model, **settings)
    want = reference(model, PROMPT, 0.0)
    for lease_id in (1, 2):   # the second time its prefix is cached
        spec = P.SeqSpec(1, P.pack_i32(PROMPT), len(PROMPT), 2, num_prompt_logprobs=3)
        _, _, prompt = run(core, lease_of(lease_id, PROMPT, spec, 2))
        assert prompt is not None and len(prompt) == len(PROMPT) - 1
        for i, (values, top) in enumerate(prompt):
            at = want[i]
            token = PROMPT[i + 1]
            assert abs(values[0] - float(at[token])) < TOL
            assert int(values[1]) == int((at > at[token]).sum()) + 1
            assert np.allclose(values[2:5], at.topk(3).values.numpy(), atol=TOL)
        core.drop([1])


def test_rows_that_do_not_ask_carry_nothing(model):
    core = make_core(model)
    _, rows, prompt = run(core, lease_of(1, PROMPT, spec_of(PROMPT, temperature=0.5, seed=1), 3))
    assert rows == [] and prompt is None


# --- through the official client ---------------------------------------------------------

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def ref(tiny_chat_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_chat_model_dir)


@pytest.mark.slow
def test_logprobs_through_the_official_client(http_node, ref):
    """Chat and completions, streamed and not: each token's logprob and top alternatives equal
    transformers'; echo puts the prompt's text and logprobs first; prompt_logprobs as vLLM's;
    bounds errors name their field."""
    model, tok = ref
    client = http_node.client
    ids = tok.encode("Once upon a time")
    args = dict(model="tiny", prompt=ids, max_tokens=5, temperature=0.7, seed=3)
    whole = client.completions.create(**args, logprobs=3)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == whole.usage.completion_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.completions.create(**args, logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs is not None]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    prompt_ids = tok.encode(prompt_ids, add_special_tokens=False)
    for c in content:   # the greedy token is the likeliest: its own top alternative
        assert c.top_logprobs[0].token == c.token and abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6
    with torch.no_grad():
        ids_out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=len(content),
                                 do_sample=False)[0, len(prompt_ids):].tolist()
    want = reference(model, prompt_ids + ids_out, 0.0)
    for i, (c, t) in enumerate(zip(content, ids_out)):
        assert abs(c.logprob - float(want[len(prompt_ids) - 1 + i, t])) < TOL
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=2, stream=True)
    parts = [c.choices[0].logprobs.content for c in stream if c.choices and c.choices[0].logprobs is not None]
    assert [c.logprob for p in parts for c in p] == [c.logprob for c in content]

    echo = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=2, temperature=0,
                                     echo=True, logprobs=1, extra_body={"prompt_logprobs": 2})
    choice = echo.choices[0]
    assert choice.text.startswith("Once upon a time")
    plp = choice.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids) + 2
    assert choice.logprobs.text_offset[len(ids)] == len("Once upon a time")   # offsets index the text
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    want = reference(model, ids, 0.0)
    for i in range(1, len(ids)):
        assert abs(choice.logprobs.token_logprobs[i] - float(want[i - 1, ids[i]])) < TOL
        assert abs(plp[i][str(ids[i])]["logprob"] - float(want[i - 1, ids[i]])) < TOL
    # several choices, streamed and not: each its own tokens' logprobs
    many = client.completions.create(model="tiny", prompt=["Hi", "Once"], n=2, max_tokens=3, temperature=0.9,
                                     seed=5, logprobs=2)
    assert [len(c.logprobs.tokens) for c in many.choices] == [3] * 4
    chunks = client.completions.create(model="tiny", prompt=["Hi", "Once"], n=2, max_tokens=3, temperature=0.9,
                                       seed=5, logprobs=2, stream=True)
    per_choice: dict[int, list] = {}
    for c in chunks:
        for choice in c.choices:
            if choice.logprobs is not None:
                per_choice.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    assert per_choice == {c.index: c.logprobs.token_logprobs for c in many.choices}
    for field, kw in (("top_logprobs", dict(logprobs=True, top_logprobs=21)),
                      ("top_logprobs", dict(top_logprobs=2))):
        with pytest.raises(openai.BadRequestError, match=f"'{field}'") as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], **kw)
        assert info.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="'logprobs' must be an integer from 0 to 20"):
        client.completions.create(model="tiny", prompt="Hi", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="'prompt_logprobs'"):
        client.completions.create(model="tiny", prompt="Hi", extra_body={"prompt_logprobs": -3})


# --- one set of bounds on every input path -------------------------------------------------

@pytest.mark.parametrize("field,value", [("logprobs", 21), ("logprobs", True), ("prompt_logprobs", 2.5),
                                         ("prompt_logprobs", 21)])
def test_stdin_jsonl_and_http_refuse_the_same_values_naming_the_field(field, value):
    from tokenizer_util import build_tokenizer
    from qmigrate.ingest.openai_api import ApiError, parse_body
    from qmigrate.ingest.prompts import PromptError, parse_line
    tok = build_tokenizer()
    with pytest.raises(PromptError, match=f"'{field}' must be an integer from 0 to 20") as info:
        parse_line(json.dumps({"prompt": "hi", field: value}), mode="jsonl", line_no=1, tokenizer=tok, max_context=64)
    assert info.value.param == field
    with pytest.raises(ApiError, match=f"'{field}' must be an integer from 0 to 20") as info:
        parse_body({"model": "m", "prompt": "hi", field: value}, "completion", model_names=["m"], tokenizer=tok,
                   max_context=64)
    assert info.value.param == field and info.value.status == 400


def test_requests_carry_what_they_ask_for_to_the_wire():
    from tokenizer_util import build_tokenizer
    from qmigrate.ingest.openai_api import fan_out, parse_body
    from qmigrate.ingest.prompts import to_spec
    tok = build_tokenizer()
    kw = dict(model_names=["m"], tokenizer=tok, max_context=64)
    req = parse_body({"model": "m", "prompt": "hi there", "logprobs": 2, "echo": True}, "completion", **kw)
    spec = to_spec(fan_out(req, "r")[0], 1, 0, [])
    assert (spec.num_logprobs, spec.num_prompt_logprobs, req.echo, req.prompt_texts) == (2, 2, True, ["hi there"])
    req = parse_body({"model": "m", "prompt": "hi", "prompt_logprobs": 4}, "completion", **kw)
    spec = to_spec(fan_out(req, "r")[0], 1, 0, [])
    assert (spec.num_logprobs, spec.num_prompt_logprobs) == (-1, 4)
    plain = to_spec(fan_out(parse_body({"model": "m", "prompt": "hi", "logprobs": False}, "completion", **kw),
                            "r")[0], 1, 0, [])
    assert (plain.num_logprobs, plain.num_prompt_logprobs) == (-1, -1)


# --- a batch where some rows ask: the engine's path, on the CPU and on a GPU's fast runner ---

_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device,runner,tol", [("cpu", "hf", TOL),
                                               pytest.param("cuda", "fast", 1e-3, marks=_GPU)])
def test_a_batch_where_some_rows_ask(tiny_model_dir, device, runner, tol):
    """Rows that ask get their sampled token's logprob and top k (a prompt's too), rows that do
    not get nothing and the same tokens as when none asks; a decode step (CUDA graphs on a GPU)
    of some rows asking, then of all. fp32; a GPU's kernels round differently, hence its tolerance."""
    from qmigrate.engine.rows import StepRow
    model, _ = load_model(tiny_model_dir, device, "float32")
    engine = Engine(model, runner=runner, max_num_seqs=16, max_kv_tokens=1 << 14)
    plain = Engine(model, runner=runner, max_num_seqs=16, max_kv_tokens=1 << 14)
    r = np.random.default_rng(5)
    prompts = [[1] + r.integers(3, 1400, size=int(r.integers(4, 40))).tolist() for _ in range(6)]
    asks = [3 if i % 2 else -1 for i in range(6)]
    rows = [StepRow(i, p, 0, 0, 0.8, 1.0, 0, 100 + i, num_logprobs=asks[i], num_prompt_logprobs=2 if i == 1 else -1)
            for i, p in enumerate(prompts)]
    ids = {i: list(p) for i, p in enumerate(prompts)}
    for step in range(3):
        pending = engine.launch(rows)
        tokens = engine.collect(pending)
        assert tokens == plain.step([StepRow(*[getattr(x, f) for f in ("seq_id", "new_ids", "start", "index",
                                                                         "temperature", "top_p", "top_k", "seed")])
                                     for x in rows])
        got, prompt = engine.take_logprobs(pending)
        assert sorted(got) == [i for i in range(6) if rows[i].num_logprobs >= 0]
        for i, token in enumerate(tokens):
            if i in got:
                with torch.no_grad():
                    logits = model(torch.tensor([ids[i]], device=device)).logits[0, -1].float().cpu()
                want = (logits / 0.8).log_softmax(-1)
                block, top_ids, row = got[i]
                values = block[row]
                k = rows[i].num_logprobs
                assert abs(values[0] - float(want[token])) < tol
                assert np.allclose(values[1:1 + k], want.topk(k).values.numpy(), atol=tol)
            ids[i].append(token)
        if step == 0:
            with torch.no_grad():
                raw = model(torch.tensor([prompts[1]], device=device)).logits[0].float().cpu().log_softmax(-1)
            values, top = prompt[1]
            assert list(prompt) == [1] and len(values) == len(prompts[1]) - 1
            assert np.allclose(values[:, 0], raw[np.arange(len(prompts[1]) - 1), prompts[1][1:]].numpy(), atol=tol)
        every = step >= 1   # the last step: every row asks
        rows = [StepRow(i, [ids[i][-1]], len(ids[i]) - 1, step + 1, 0.8, 1.0, 0, 100 + i,
                        num_logprobs=2 if every else asks[i]) for i in range(6)]


# --- on the wire ---------------------------------------------------------------------------

def _block(n: int, k: int, extra: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.standard_normal((n, extra + k)).astype(np.float32), r.integers(0, 500, size=(n, k)).astype(np.int32)


def test_logprob_arrays_are_checked_at_decode_and_kept_with_their_rows():
    """A Tokens whose logprob arrays do not fit its tokens is refused; the router's and ingest's
    selections of rows keep each row's logprobs (and prompt's) with it."""
    from qmigrate.ingest.handoff import logprobs_of, rows_of
    block = _block(5, 2, 1, 0)
    width, values, ids = P.pack_logprob_refs([(*block, k) for k in range(5)], 1)
    prompt = _block(3, 2, 2, 1)
    _, pv, pi = P.pack_logprob_refs([(*prompt, k) for k in range(3)], 2)
    assert width == 2 and values == block[0].tobytes()
    narrow = _block(2, 1, 1, 2)   # refs into two arrays of different widths: padded to the widest
    _, v2, i2 = P.pack_logprob_refs([(*narrow, 1), None, (*block, 4)], 1)
    v2, i2 = P.unpack_logprob_block(v2, i2, 3, 2, 1)
    assert np.isnan(v2[1]).all() and (i2[1] == -1).all() and (v2[2] == block[0][4]).all()
    assert (v2[0, :2] == narrow[0][1]).all() and np.isnan(v2[0, 2]) and i2[0].tolist() == [narrow[1][1, 0], -1]
    msg = P.Tokens(P.pack_i64([7, 8]), P.pack_i32([0, 4]), P.pack_i32([3, 2]), P.pack_i32([1, 2, 3, 4, 5]),
                   P.pack_u8([0, 0]), lp_width=2, lp_values=values, lp_top_ids=ids,
                   prompt_counts=P.pack_i32([3, 0]), prompt_width=2, prompt_values=pv, prompt_top_ids=pi)
    assert codec.decode(codec.encode(msg)) == msg
    for bad in (dict(lp_values=values[:-4]), dict(lp_width=21), dict(prompt_counts=P.pack_i32([2, 0])),
                dict(lp_width=-1)):
        with pytest.raises(P.ProtocolError):
            codec.decode(codec.encode(P.Tokens(**{**{f: getattr(msg, f) for f in msg.__dataclass_fields__}, **bad})))
    kept = P.logprob_rows(msg, P.Tokens(P.pack_i64([8]), P.pack_i32([4]), P.pack_i32([2]), P.pack_i32([4, 5]),
                                         P.pack_u8([0])), np.array([False, True]))
    got = P.unpack_logprob_block(kept.lp_values, kept.lp_top_ids, 2, 2, 1)
    assert (got[0] == block[0][3:]).all() and (got[1] == block[1][3:]).all()
    assert P.unpack_i32(kept.prompt_counts).tolist() == [0] and codec.decode(codec.encode(kept)) == kept

    replies = P.replies_with_logprobs(
        P.Replies(P.pack_i64([7, 8, 9]), P.pack_u8([0, 0, 0]), P.pack_i32([3, 2, 1]), ["a", "b", "c"]),
        [[(1, (*block, 0)), (2, (*block, 1))], None, [(9, None)]], [prompt, None, None])
    replies = codec.decode(codec.encode(replies))
    part = codec.decode(codec.encode(rows_of(replies, np.array([0, 2]))))
    lps, prompts = logprobs_of(part)
    assert [t for t, _, _ in lps[0]] == [1, 2] and lps[0][1][1] == block[0][1].tolist()
    assert lps[1] == [(9, None, None)] and len(prompts[0]) == 3 and prompts[1] is None
    assert prompts[0][2] == (prompt[0][2].tolist(), prompt[1][2].tolist())
