"""OpenAI request parsing and reply shapes (pure), and the detokenizer's reply route."""

from __future__ import annotations

import copy

import pytest

from conftest import CHAT_TEMPLATE
from qmigrate.detokenizer.formats import make_sink
from qmigrate.ingest.openai_api import ApiError, fan_out, parse_body
from qmigrate.ingest.openai_replies import StopTrimmer, chunk, reply, total_usage, usage_chunk
from qmigrate.ingest.prompts import to_spec
from tokenizer_util import build_tokenizer

MODEL = "tiny"


@pytest.fixture(scope="module")
def tok():
    tok = copy.deepcopy(build_tokenizer())
    tok.chat_template = CHAT_TEMPLATE
    return tok


def parse(tok, body, kind="completion", max_context=64):
    return parse_body(body, kind, model_names=[MODEL], tokenizer=tok, max_context=max_context, eos_ids=[1])


def error(tok, body, kind="completion", **kw) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(tok, body, kind, **kw)
    return info.value


def test_a_completion_request_maps_onto_intake(tok):
    req = parse(tok, {"model": MODEL, "prompt": "Hello world", "max_tokens": 7, "temperature": 0.5,
                      "top_p": 0.9, "seed": 3, "stop": "\n", "stream": True,
                      "stream_options": {"include_usage": True}, "n": 1, "logprobs": None, "user": "u"})
    assert (req.kind, req.model, req.stream, req.include_usage, req.stop) == ("completion", MODEL, True, True, ["\n"])
    p = req.prompt
    assert p.prompt_ids == tok.encode("Hello world")
    assert (p.max_new_tokens, p.temperature, p.top_p, p.seed) == (7, 0.5, 0.9, 3)
    assert p.stop_ids == [tok.encode("\n", add_special_tokens=False)]
    assert parse(tok, {"model": MODEL, "prompt": [5, 6, 7]}).prompt.prompt_ids == [5, 6, 7]
    assert parse(tok, {"model": MODEL, "prompt": ["Hi"]}).prompt.prompt_ids == tok.encode("Hi")
    assert p.cache_salt == ""
    salted = parse(tok, {"model": MODEL, "prompt": "Hi", "cache_salt": "tenant-7"}).prompt
    assert salted.cache_salt == "tenant-7" and to_spec(salted, 1, 0, ()).cache_salt == "tenant-7"


def test_sampling_controls_reach_the_intake_from_both_endpoints(tok):
    controls = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "min_p": 0.2,
                "logit_bias": {"5": 3}, "stop_token_ids": [7], "min_tokens": 1}
    for body, kind in (({"model": MODEL, "prompt": "x", **controls}, "completion"),
                       ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], **controls}, "chat")):
        p = parse(tok, body, kind).prompt
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.logit_bias,
                p.stop_token_ids, p.min_tokens) == (0.5, 0.25, 1.1, 0.2, {5: 3.0}, [7], 1)


def test_a_chat_request_uses_the_template(tok):
    messages = [{"role": "user", "content": "Hello"}]
    req = parse(tok, {"model": MODEL, "messages": messages, "max_completion_tokens": 4}, "chat")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert req.prompt.prompt_ids == tok.encode(text, add_special_tokens=False)
    assert req.prompt.max_new_tokens == 4


@pytest.mark.parametrize("body, status, param, words", [
    ([1, 2], 400, None, "must be a JSON object"),
    ({"prompt": "x"}, 400, "model", "'model' is required"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "model", "does not exist"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature", "from 0 to 2"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed", "seed"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "only"),
    ({"model": MODEL, "prompt": "x", "stop": ["a"] * 65}, 400, "stop", "'stop' holds at most 64"),  # as on stdin
    ({"model": MODEL, "prompt": "x", "stop": ["a", 5]}, 400, "stop", "'stop' must be"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "'n' must be an integer from 1 to 128"),
    ({"model": MODEL, "prompt": "x", "n": 129}, 400, "n", "from 1 to 128"),
    ({"model": MODEL, "prompt": "x", "n": "2"}, 400, "n", "'n' must be an integer"),
    ({"model": MODEL, "prompt": [[5]] * 5, "n": 128}, 400, "n", "5 prompt(s) with n=128 is 640 choices"),
    ({"model": MODEL, "prompt": [[5]] * 513}, 400, "prompt", "at most 512 prompts"),
    ({"model": MODEL, "prompt": ["a", "  "], "n": 2}, 400, "prompt", "prompt[1]: 'prompt' is empty"),
    ({"model": MODEL, "prompt": [[5], [5, 512]]}, 400, "prompt", "prompt[1]: 'prompt_ids[1]' = 512 is out of range"),
    ({"model": MODEL, "prompt": [[5], []]}, 400, "prompt", "prompt[1]: 'prompt_ids' must be a non-empty list"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "'logprobs' must be an integer from 0 to 20"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of", "'n' asks for several choices"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, 400, "echo", "'echo' must be a boolean"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "from -2 to 2"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias", "'logit_bias[5]' must be"),
    ({"model": MODEL, "prompt": "x", "min_p": -1}, 400, "min_p", "'min_p' must be"),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate",
     "'frobnicate' is an unrecognized request argument"),
    ({"model": MODEL, "prompt": "x", "prediction": {}}, 400, "prediction", "unrecognized"),  # chat's only
    ({"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "'max_tokens' (4)"),
    ({"model": MODEL, "prompt": ["a", "b"], "top_k": -1}, 400, "top_k", "'top_k' must be"),
    ({"model": MODEL, "prompt": "x", "cache_salt": 7}, 400, "cache_salt", "'cache_salt' must be a string"),
    ({"model": MODEL, "prompt": "x", "cache_salt": "s" * 257}, 400, "cache_salt", "at most 256"),
    ({"model": MODEL, "prompt": [5, "b"]}, 400, "prompt", "a list of token ids, or a list of those"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt", "string, a list of token ids"),
    ({"model": MODEL, "prompt": "   "}, 400, "prompt", "'prompt' is empty"),
    ({"model": MODEL, "prompt": "The quick brown fox " * 20}, 400, "prompt", "context"),
])
def test_bad_completion_requests(tok, body, status, param, words):
    exc = error(tok, body)
    assert (exc.status, exc.param) == (status, param)
    assert words in exc.message
    assert set(exc.body()["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_over_the_context_has_its_code(tok):
    assert error(tok, {"model": MODEL, "prompt": "The quick brown fox " * 20}).code == "context_length_exceeded"
    long_second = error(tok, {"model": MODEL, "prompt": ["Hi", "The quick brown fox " * 20], "n": 2})
    assert long_second.code == "context_length_exceeded" and long_second.message.startswith("prompt[1]: ")


def test_a_batch_with_n_fans_out_one_choice_per_prompt_and_n_as_vllm_numbers_them(tok):
    req = parse(tok, {"model": MODEL, "prompt": ["Hello", [5, 6, 7]], "n": 3, "seed": 10, "max_tokens": 4})
    assert (req.n, req.num_choices, [p.prompt_ids for p in req.prompts]) == (3, 6, [tok.encode("Hello"), [5, 6, 7]])
    choices = fan_out(req, "cmpl-1")
    assert [c.req_id for c in choices] == [f"cmpl-1-{i}" for i in range(6)]
    assert [c.prompt_ids for c in choices] == [tok.encode("Hello")] * 3 + [[5, 6, 7]] * 3  # index = p * n + j
    assert [c.seed for c in choices] == [10, 11, 12] * 2  # seed + j, as vLLM's child requests
    assert all(c.max_new_tokens == 4 for c in choices)
    assert choices[0].prompt_ids is choices[2].prompt_ids  # shared, not copied per choice
    unseeded = fan_out(parse(tok, {"model": MODEL, "prompt": "Hi", "n": 2}), "c")
    assert [c.seed for c in unseeded] == [None, None]  # ingest draws a seed for each
    top = fan_out(parse(tok, {"model": MODEL, "prompt": "Hi", "n": 2, "seed": 2**63 - 1}), "c")
    assert [c.seed for c in top] == [2**63 - 1, 0]  # wraps within the wire's range
    one = parse(tok, {"model": MODEL, "prompt": [[5, 6]]})
    assert fan_out(one, "c") == [one.prompt] and one.prompt.req_id == "c"  # a batch of one is one request
    chat = fan_out(parse(tok, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, "chat"), "r")
    assert len(chat) == 2 and chat[0].prompt_ids == chat[1].prompt_ids


def test_usage_counts_each_prompt_once_and_every_choice(tok):
    req = parse(tok, {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "n": 2})
    outcomes = [("a", "length", 4, 2), ("b", "stop", 1, 0), ("c", "length", 4, -1), ("d", "length", 3, 1)]
    whole = reply(req, "r", 1, outcomes)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == \
        [(0, "a", "length"), (1, "b", "stop"), (2, "c", "length"), (3, "d", "length")]
    # prompt tokens once per prompt (3 + 2); cached: the fewest of each prompt's choices (0, then 1)
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    assert usage_chunk(req, "r", 1, [(n, c) for _, _, n, c in outcomes])["usage"] == whole["usage"]
    assert "prompt_tokens_details" not in total_usage(req, [(1, -1)] * 4)
    assert chunk(req, "r", 1, "x", index=3)["choices"][0]["index"] == 3


@pytest.mark.parametrize("body, param, words", [
    ({"model": MODEL, "messages": []}, "messages", "non-empty list"),
    ({"model": MODEL, "messages": "hi"}, "messages", "non-empty list"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 1}]}, "messages",
     "'messages[0].content' must be a string"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs", "must be a boolean"),
    ({"model": MODEL, "prompt": "x"}, "prompt", "unrecognized"),
])
def test_bad_chat_requests(tok, body, param, words):
    exc = error(tok, body, "chat")
    assert (exc.status, exc.param) == (400, param) and words in exc.message


def test_neutral_values_of_unsupported_fields_are_accepted(tok):
    parse(tok, {"model": MODEL, "prompt": "x", "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0,
                "logit_bias": {}, "echo": False, "best_of": 1, "logprobs": None})
    parse(tok, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "modalities": ["text"],
                "response_format": {"type": "text"}, "tool_choice": "none"}, "chat")


def test_fields_that_change_nothing_generated_are_accepted_and_ignored(tok):
    """Clients send these whatever the server; they were refused as unrecognized."""
    ignored = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u",
               "prompt_cache_key": "k", "safety_identifier": "s"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    plain = parse(tok, chat, "chat").prompt
    assert parse(tok, {**chat, **ignored, "parallel_tool_calls": False,
                       "prediction": {"type": "content", "content": "x"}}, "chat").prompt == plain
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 3}
    assert parse(tok, {**completion, **ignored}).prompt == parse(tok, completion).prompt


@pytest.mark.parametrize("name, value", [("audio", {"voice": "alloy", "format": "wav"}), ("reasoning_effort", "low"),
                                         ("modalities", ["text", "audio"]), ("web_search_options", {})])
def test_chat_fields_that_would_change_the_output_are_refused_by_name(tok, name, value):
    exc = error(tok, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], name: value}, "chat")
    assert (exc.status, exc.param) == (400, name) and exc.message.startswith(f"'{name}' is not supported")


def test_every_error_names_its_field_in_quotes(tok):
    """One style on both input paths: the message names the field as 'name', and the error's
    param is the API's name of it."""
    for body, kind, param in [({"model": MODEL, "prompt": "x", "top_p": 2}, "completion", "top_p"),
                              ({"model": MODEL, "prompt": "x", "temperature": 9}, "completion", "temperature"),
                              ({"model": MODEL, "prompt": "x", "ignore_eos": 1}, "completion", "ignore_eos"),
                              ({"model": MODEL, "prompt": "x", "stop": [[1]]}, "completion", "stop"),
                              ({"model": MODEL, "messages": [{"role": "x", "content": "y"}]}, "chat", "messages"),
                              ({"model": MODEL, "messages": [{"role": "user", "content": "y"}],
                                "max_completion_tokens": 0}, "chat", "max_completion_tokens")]:
        exc = error(tok, body, kind)
        assert exc.param == param and f"'{param}" in exc.message, (body, exc.message)


def test_stop_trimmer_holds_back_and_cuts_a_final_stop_string():
    trim = StopTrimmer(["\n\n", "END"])
    out = trim.push("Hello") + trim.push(" wor") + trim.push("ld\n") + trim.push("\n")
    assert out + trim.finish(stopped=True) == "Hello world"
    trim = StopTrimmer(["END"])
    assert trim.push("abEN") + trim.push("D") + trim.finish(stopped=False) == "abEND"
    assert StopTrimmer([]).push("xyz") == "xyz"


def test_reply_and_chunk_shapes(tok):
    req = parse(tok, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                      "stream_options": {"include_usage": True}}, "chat")
    n = len(req.prompt.prompt_ids)
    first = chunk(req, "r", 1, "He", first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert chunk(req, "r", 1, None, "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                                 "finish_reason": "length"}
    assert usage_chunk(req, "r", 1, [(4, -1)])["usage"] == {"prompt_tokens": n, "completion_tokens": 4,
                                                            "total_tokens": n + 4}
    whole = reply(req, "r", 1, [("Hello", "stop", 2, -1)])
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert whole["usage"]["completion_tokens"] == 2


def test_the_detokenizer_routes_text_back_and_reports_every_end():
    tok = build_tokenizer()
    printed, replies = [], []
    sink = make_sink("jsonl", tok, printed.append, reply=lambda *row: replies.append(row))
    ids = tok.encode(" hello world", add_special_tokens=False)
    sink.start(1, "http-1", [0], route=1)
    sink.start(2, "q2", [0])
    sink.cached(1, 3)
    sink.cached(1, 7)   # only the first start counts
    sink.tokens(1, 0, ids)
    sink.tokens(2, 0, ids)
    sink.finish(1, "length", len(ids))
    sink.finish(2, "eos", len(ids))
    assert "".join(r[1] for r in replies if r[0] == 1) == tok.decode(ids)
    assert [r for r in replies if r[2]] == [(1, "", 2, len(ids), 3), (2, "", 1, len(ids), -1)]
    assert all('"http-1"' not in line for line in printed)  # routed text is never printed
    assert (sink.num_done, sink.num_replied) == (1, 1)


def test_a_routed_request_hears_of_every_token_even_one_that_completes_no_character():
    tok = build_tokenizer()
    replies = []
    sink = make_sink("text", tok, lambda text: None, reply=lambda *row: replies.append(row))
    ids = tok.encode(" a\u20acb", add_special_tokens=False)   # the euro sign is three byte tokens here
    assert len(ids) == 5
    sink.start(4, "http-4", [0], route=1)
    for i, token in enumerate(ids):
        sink.tokens(4, i, [token])
    sink.finish(4, "length", len(ids))
    # one row per token: the two that end mid-character carry no text, and the third the sign
    assert [(r[1], r[3]) for r in replies if not r[2]] == [(" a", 1), ("", 2), ("", 3), ("\u20ac", 4), ("b", 5)]
    assert replies[-1][2] == 2


def test_cancel_ends_a_request_once_and_drops_later_tokens():
    tok = build_tokenizer()
    printed, replies = [], []
    sink = make_sink("jsonl", tok, printed.append, reply=lambda *row: replies.append(row))
    ids = tok.encode(" hello world", add_special_tokens=False)
    sink.start(3, "c", [0])
    sink.tokens(3, 0, ids[:1])
    sink.cancel(3)
    sink.cancel(3)
    sink.tokens(3, 1, ids[1:])
    final = [line for line in printed if '"done": true' in line]
    assert len(final) == 1 and '"finish_reason": "cancelled"' in final[0]
    assert replies[-1] == (3, "", 100, 1, -1)
    assert sink.num_done == 1 and sink.num_dropped_tokens == len(ids) - 1


def test_usage_carries_cached_prompt_tokens_when_known():
    from qmigrate.ingest.openai_replies import usage
    assert usage(10, 4) == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    assert usage(10, 4, 8)["prompt_tokens_details"] == {"cached_tokens": 8}
    assert usage(10, 4, 0)["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("max_name", ["max_tokens", "max_completion_tokens"])
def test_min_tokens_past_the_maximum_names_the_field_the_client_sent(tok, max_name):
    kind = "chat" if max_name == "max_completion_tokens" else "completion"
    body = {"model": MODEL, max_name: 3, "min_tokens": 5,
            **({"messages": [{"role": "user", "content": "Hi"}]} if kind == "chat" else {"prompt": "Hi"})}
    exc = error(tok, body, kind)
    assert exc.status == 400 and exc.param == "min_tokens"
    assert max_name in exc.message and "max_new_tokens" not in exc.message, exc.message
