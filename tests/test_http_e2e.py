"""The official `openai` client against a live node (router, ingest with the HTTP API,
detokenizer, one CPU worker) on the tiny model with a chat template."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "tiny"
PROMPTS = ["Hello world", "Once upon a time", "The router keeps"]


@pytest.fixture(scope="module")
def node(http_node):
    return http_node


@pytest.fixture(scope="module")
def expected(tiny_chat_model_dir):
    """The text and token count transformers' greedy generate() gives for prompt ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)

    def generate(prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, len(prompt_ids):].tolist()
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return decode(prompt_ids + new)[len(decode(prompt_ids)):], len(new)
    generate.tok = tok
    return generate


def test_completions_streamed_and_not_equal_generate(node, expected):
    for prompt in PROMPTS[:1]:
        text, num = expected(expected.tok.encode(prompt), 8)
        whole = node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert whole.choices[0].text == text
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected.tok.encode(prompt)), num)
        stream = node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == num
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_chat_completions_streamed_and_not_equal_generate(node, expected):
    messages = [{"role": "user", "content": "Tell me a story"}]
    tok = expected.tok
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    text, num = expected(ids, 6)
    whole = node.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), num)
    chunks = list(node.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_64_concurrent_streaming_clients_all_complete(node, expected):
    wanted = {p: expected(expected.tok.encode(p), 4)[0] for p in PROMPTS}

    def one(i: int) -> tuple[str, str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        stream = node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
        chunks = list(stream)
        return prompt, "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert len(results) == 64
    for prompt, text, finish in results:
        assert text == wanted[prompt] and finish in ("length", "stop")


def test_a_client_that_closes_mid_stream_frees_its_sequence(node):
    """The closed stream's sequence is cancelled. The worker is held (SIGSTOP) once the first
    event is read, and the stream closed only while the router still counts the sequence live:
    the tiny model can write all of its 500 tokens first (its first event comes after a lease
    of several steps), and such a try is made again."""
    import helpers as H
    worker = H.pid_of(node.proc, "qmigrate worker")
    for _ in range(5):
        before = H.wait_for("no sequence live", lambda s: s["live"] == 0, node.router, timeout=30)
        stream = node.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=500, stream=True)
        next(iter(stream))  # generating now
        H.pause(worker)
        try:
            live = node.stats()["live"]
            stream.close()
            if live:
                H.wait_for("the cancel at the router", lambda s: s.get("cancelled", 0) > before.get("cancelled", 0),
                           node.router, timeout=30)
        finally:
            H.resume(worker)
        if live:
            break
    else:
        pytest.fail("every try's sequence ended before its worker was held")
    stats = H.wait_for("no sequence live", lambda s: s["live"] == 0, node.router, timeout=30)
    counts = (stats.get("cancelled", 0) - before.get("cancelled", 0),
              stats.get("finished", 0) - before.get("finished", 0), stats["live"])
    assert counts == (1, 0, 0), f"(cancelled, finished, live): {counts}; stats {stats}"


def test_bad_input_gets_4xx_and_the_server_keeps_serving(node):
    with pytest.raises(openai.NotFoundError):
        node.client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer from 1 to 128"):
        node.client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=129)
    with pytest.raises(openai.BadRequestError, match="'best_of'"):
        node.client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=2)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]: .*context"):  # nothing of it runs
        node.client.completions.create(model=MODEL, prompt=[[5, 6], [5] * 600], max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        node.client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        node.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert node.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].finish_reason


def test_duplicate_live_ids_are_refused_and_reusable_after_the_end(node):
    node.feed(json.dumps({"id": "dup", "prompt": "Hello", "max_new_tokens": 6}),
              json.dumps({"id": "dup", "prompt": "Once", "max_new_tokens": 6}))
    records = node.records({"dup"})
    deadline = time.monotonic() + 30
    while sum(1 for r in records if r["id"] == "dup" and r.get("done")) < 2 and time.monotonic() < deadline:
        records = node.records({"dup"})
    finals = [r for r in records if r["id"] == "dup" and r.get("done")]
    assert len(finals) == 2
    assert sum("duplicate id 'dup'" in r.get("error", "") for r in finals) == 1
    assert sum("text" in r for r in finals) == 1
    deltas = [r["delta"] for r in records if r["id"] == "dup" and "delta" in r]
    assert "".join(deltas) == next(r["text"] for r in finals if "text" in r)  # one stream, not two
    node.feed(json.dumps({"id": "dup", "prompt": "Hello", "max_new_tokens": 6}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finals = [r for r in node.records({"dup"}) if r["id"] == "dup" and r.get("done")]
        if len(finals) == 3:
            break
        time.sleep(0.05)
    assert len(finals) == 3 and "text" in finals[2]


def test_a_jsonl_cancel_line_ends_a_request(node):
    node.feed(json.dumps({"id": "long", "prompt": "Hello", "max_new_tokens": 400}), json.dumps({"cancel": "long"}))
    final = [r for r in node.records({"long"}) if r["id"] == "long" and r.get("done")]
    assert final[0]["finish_reason"] == "cancelled"


def test_usage_says_how_much_of_the_prompt_was_cached(node):
    prompt = "the river forgot a lost key because the night train whispered to the orchestra " * 3
    first = node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 32
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    # another tenant's salt shares nothing; the same salt again shares the prefix
    salted = [node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                             extra_body={"cache_salt": "tenant-b"}) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in salted] == [0, (n - 1) // 16 * 16]
    assert salted[0].choices[0].text == first.choices[0].text


def test_n_greedy_choices_are_equal_and_a_batch_of_ids_maps_each_choice_to_its_prompt(node, expected):
    ids = expected.tok.encode(PROMPTS[0])
    text, num = expected(ids, 6)
    three = node.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, n=3)
    assert [(c.index, c.text) for c in three.choices] == [(0, text), (1, text), (2, text)]
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (len(ids), 3 * num)

    batch_ids = [expected.tok.encode(p) for p in PROMPTS[1:]]
    single = [node.client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
              for p in batch_ids]
    assert single == [expected(p, 6)[0] for p in batch_ids]
    batch = node.client.completions.create(model=MODEL, prompt=batch_ids, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [single[0], single[0], single[1], single[1]]  # index = p * n + j
    assert batch.usage.prompt_tokens == sum(map(len, batch_ids))  # each prompt once, as vLLM counts
    assert batch.usage.completion_tokens == 2 * sum(expected(p, 6)[1] for p in batch_ids)

    stream = node.client.completions.create(model=MODEL, prompt=batch_ids, max_tokens=6, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True})
    texts, finishes, chunks = {}, {}, list(stream)
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {i: single[i // 2] for i in range(4)} and sorted(finishes) == [0, 1, 2, 3]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == batch.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens

    chat = node.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_seeded_choices_differ_from_each_other_and_repeat_as_requests_of_seed_plus_j(node):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)
    texts = [c.text for c in node.client.completions.create(n=3, **args).choices]
    assert len(set(texts)) == 3
    assert [c.text for c in node.client.completions.create(n=3, **args).choices] == texts
    alone = [node.client.completions.create(**{**args, "seed": 7 + j}).choices[0].text for j in range(3)]
    assert alone == texts


def test_the_agreement_client_finds_greedy_answers_equal_at_once_and_one_at_a_time(node, tiny_chat_model_dir,
                                                                                    tmp_path, capsys):
    """`benchmarks.agree`, the GPU comparison of a split worker with one GPU, on the CPU in
    fp32, where the batch a call runs in changes nothing."""
    from benchmarks import agree
    for name, extra in (("all", []), ("one", ["--one-at-a-time"])):
        agree.main(["run", "--base-url", node.url, "--out", str(tmp_path / f"{name}.json"), "--prompts", "6",
                    "--tokens", "8", "--vocab", "10:1000", *extra])
    agree.main(["compare", "--tokenizer", str(tiny_chat_model_dir), str(tmp_path / "all.json"),
                str(tmp_path / "one.json")])
    out = capsys.readouterr().out
    assert "6 of 6 answers identical" in out and "(1.000)" in out, out


def test_a_killed_ingest_starts_again_and_its_clients_requests_are_cancelled(node):
    """Last in this module: it restarts the node's ingest. The HTTP clients of a killed ingest
    are gone with it; the node starts ingest again (before, the whole node stopped), and the
    router cancels the requests those clients made instead of running them for nobody."""
    import os
    import signal
    import threading
    import helpers as H

    errors = []

    def long_call():
        try:
            node.client.completions.create(model=MODEL, prompt=[1, 5, 9], max_tokens=480, n=8, stream=True,
                                           extra_body={"ignore_eos": True}).response.read()
        except Exception as exc:   # noqa: BLE001 -- its connection dies with the ingest
            errors.append(repr(exc))

    before = node.stats()
    calls = [threading.Thread(target=long_call, daemon=True) for _ in range(4)]   # 32 sequences of 480
    for call in calls:
        call.start()
    deadline = time.monotonic() + 30
    while node.stats().get("live", 0) < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node.stats().get("live", 0) >= 16, (node.stats(), errors, node.stderr.read_text()[-3000:])
    os.kill(H.pid_of(node.proc, "qmigrate ingest"), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while node.stats().get("live", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = node.stats()
    assert after.get("live", 0) == 0, after
    assert "ingest exited with status -9; starting it again" in node.stderr.read_text()
    assert after.get("cancelled", 0) - before.get("cancelled", 0) >= 16, after
    node.wait_ready()
    answer = node.client.completions.create(model=MODEL, prompt=[1, 5, 9], max_tokens=4, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 4


def test_what_clients_send_unasked_is_accepted_and_the_utility_endpoints_answer(node, expected):
    """The official client's `store`, `metadata`, `service_tier`, `user`, `prediction` change
    nothing; an unknown field is one 400 naming it; models.retrieve and /tokenize work."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    plain = node.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    extra = node.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, store=True, metadata={"app": "t"},
        service_tier="auto", user="u1", prediction={"type": "content", "content": "x"}, parallel_tool_calls=True)
    assert extra.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="'frobnicate' is an unrecognized request argument") as info:
        node.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                            extra_body={"frobnicate": 1})
    assert info.value.body["param"] == "frobnicate"
    assert node.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        node.client.models.retrieve("gpt-9")
    count = node.client.post("/../tokenize", body={"model": MODEL, "messages": messages}, cast_to=object)["count"]
    assert count == plain.usage.prompt_tokens


def test_sampling_controls_through_the_official_client(node, expected):
    """logit_bias forces a token; repetition_penalty then keeps it from coming again;
    stop_token_ids ends on it, but not before min_tokens; the penalties and min_p are taken
    on both endpoints (their exact values: test_controls.py)."""
    tok, forced = expected.tok, 300
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    out = node.client.completions.create(**args, logit_bias={str(forced): 100})
    assert out.choices[0].text == tok.decode([forced] * 4) and out.usage.completion_tokens == 4
    once = node.client.completions.create(**args, logit_bias={str(forced): 100},
                                          extra_body={"repetition_penalty": 100})
    assert once.choices[0].text.startswith(tok.decode([forced])) and once.choices[0].text != out.choices[0].text
    ended = node.client.completions.create(**args, logit_bias={str(forced): 100},
                                           extra_body={"stop_token_ids": [forced], "min_tokens": 2})
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 3)
    kw = dict(presence_penalty=1.5, frequency_penalty=-1.0, extra_body={"repetition_penalty": 1.5, "min_p": 0.1})
    chat = node.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, temperature=0.7, seed=1, stream=True, **kw)
    assert [c.choices[0].finish_reason for c in chat if c.choices][-1] in ("stop", "length")
    assert node.client.completions.create(**args, **kw).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="'frequency_penalty' must be a number from -2 to 2"):
        node.client.completions.create(**args, frequency_penalty=3)
