import json

import pytest

from qmigrate.ingest.prompts import Defaults, Prompt, PromptError, parse_line
from qmigrate.wire import codec
from tokenizer_util import build_tokenizer

MAX_CONTEXT = 64
EOS_ID = 1  # "</s>" in the test tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def text(tok, line, line_no=1, **kw):
    kw.setdefault("max_context", MAX_CONTEXT)
    return parse_line(line, mode="text", line_no=line_no, tokenizer=tok,
                      defaults=kw.pop("defaults", Defaults()),
                      eos_ids=kw.pop("eos_ids", [EOS_ID]), **kw)


def jsonl(tok, obj, line_no=1, **kw):
    line = obj if isinstance(obj, str) else json.dumps(obj)
    kw.setdefault("max_context", MAX_CONTEXT)
    return parse_line(line + "\n", mode="jsonl", line_no=line_no, tokenizer=tok,
                      defaults=kw.pop("defaults", Defaults()),
                      eos_ids=kw.pop("eos_ids", [EOS_ID]), **kw)


def error_of(fn, *args, **kw) -> PromptError:
    with pytest.raises(PromptError) as info:
        fn(*args, **kw)
    assert isinstance(info.value, ValueError)
    return info.value


# ---- text mode ----


def test_text_prompt_defaults(tok):
    assert tok.eos_token_id == EOS_ID
    p = text(tok, "Hello world\n", line_no=3, max_context=1000)
    assert p == Prompt(req_id="3", prompt_ids=tok.encode("Hello world"), max_new_tokens=64,
                       temperature=0.0, top_p=1.0, top_k=0, seed=None, stop_ids=[])
    assert p.prompt_ids[0] == tok.bos_token_id


def test_text_keeps_spaces_strips_line_ending_only(tok):
    assert text(tok, "  Hello world \r\n").prompt_ids == tok.encode("  Hello world ")


def test_text_defaults_object_used(tok):
    d = Defaults(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=40)
    p = text(tok, "hi", defaults=d)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k) == (5, 0.7, 0.9, 40)


@pytest.mark.parametrize("line", ["\n", "", "   \t \n", "\r\n"])
def test_text_empty_prompt(tok, line):
    err = error_of(text, tok, line, line_no=7)
    assert str(err) == "empty prompt" and err.req_id == "7"


def test_text_too_long(tok):
    line = "word " * 100
    n = len(tok.encode(line))
    err = error_of(text, tok, line, line_no=2)
    assert str(err) == f"prompt is {n} tokens; the model's context is {MAX_CONTEXT}"
    assert err.req_id == "2"


def test_context_boundary(tok):
    ids = [5] * (MAX_CONTEXT - 1)
    p = jsonl(tok, {"prompt_ids": ids, "max_new_tokens": 10})
    assert p.max_new_tokens == 1
    err = error_of(jsonl, tok, {"prompt_ids": ids + [5]})
    assert str(err) == f"prompt is {MAX_CONTEXT} tokens; the model's context is {MAX_CONTEXT}"


def test_max_new_tokens_clamped(tok):
    p = text(tok, "Hello world")
    assert p.max_new_tokens == MAX_CONTEXT - len(p.prompt_ids)
    p = jsonl(tok, {"prompt": "Hello world", "max_new_tokens": 3})
    assert p.max_new_tokens == 3


def test_trailing_eos_removed(tok):
    class AddsEos:
        def __len__(self):
            return len(tok)

        def get_vocab(self):
            return tok.get_vocab()

        def encode(self, s, add_special_tokens=True):
            return tok.encode(s, add_special_tokens=add_special_tokens) + [tok.eos_token_id]

    assert text(AddsEos(), "Hello").prompt_ids == tok.encode("Hello")
    assert text(AddsEos(), "Hello", eos_ids=[]).prompt_ids == tok.encode("Hello") + [EOS_ID]


# ---- jsonl mode ----


def test_jsonl_full(tok):
    p = jsonl(tok, {"id": "abc", "prompt": "Hello world", "max_new_tokens": 8,
                    "temperature": 1, "top_p": 0.5, "top_k": 3, "seed": 2**63 - 1,
                    "stop": ["END", [7, 8], " stop"]})
    assert p == Prompt(req_id="abc", prompt_ids=tok.encode("Hello world"), max_new_tokens=8,
                       temperature=1.0, top_p=0.5, top_k=3, seed=2**63 - 1,
                       stop_ids=[tok.encode("END", add_special_tokens=False), [7, 8],
                                 tok.encode(" stop", add_special_tokens=False)])
    assert isinstance(p.temperature, float)
    assert tok.bos_token_id not in p.stop_ids[0]


def test_jsonl_defaults_and_ids(tok):
    p = jsonl(tok, {"prompt_ids": [0, 5, 511]}, line_no=4, max_context=1000)
    assert p == Prompt(req_id="4", prompt_ids=[0, 5, 511], max_new_tokens=64, temperature=0.0,
                       top_p=1.0, top_k=0, seed=None, stop_ids=[])


def test_jsonl_int_id_and_null_fields(tok):
    p = jsonl(tok, {"id": 12, "prompt": "x", "seed": None, "top_k": None})
    assert p.req_id == "12" and p.seed is None and p.top_k == 0


def test_jsonl_stop_single_string(tok):
    p = jsonl(tok, {"prompt": "x", "stop": "END"})
    assert p.stop_ids == [tok.encode("END", add_special_tokens=False)]


@pytest.mark.parametrize("obj, message", [
    ({"prompt": "x", "foo": 1}, "'foo' is an unrecognized request argument"),
    ({"max_new_tokens": 3}, "give exactly one of 'prompt', 'prompt_ids' and 'messages'"),
    ({"prompt": "x", "prompt_ids": [1]}, "give exactly one of 'prompt', 'prompt_ids' and 'messages'"),
    ({"prompt": "  "}, "'prompt' is empty"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_ids": []}, "'prompt_ids' must be a non-empty list of token ids"),
    ({"prompt_ids": "1 2"}, "'prompt_ids' must be a non-empty list of token ids"),
    ({"prompt_ids": [1, 512]}, "'prompt_ids[1]' = 512 is out of range [0, 512)"),
    ({"prompt_ids": [-1]}, "'prompt_ids[0]' = -1 is out of range [0, 512)"),
    ({"prompt_ids": [1, True]}, "'prompt_ids[1]' must be an integer token id, got true"),
    ({"prompt_ids": [1.0]}, "'prompt_ids[0]' must be an integer token id, got 1.0"),
    ({"prompt": "x", "max_new_tokens": 0}, "'max_new_tokens' must be an integer >= 1"),
    ({"prompt": "x", "max_new_tokens": 2.0}, "'max_new_tokens' must be an integer >= 1"),
    ({"prompt": "x", "max_new_tokens": True}, "'max_new_tokens' must be an integer >= 1"),
    ({"prompt": "x", "temperature": -0.1}, "'temperature' must be a number from 0 to 2"),
    ({"prompt": "x", "temperature": "hot"}, "'temperature' must be a number from 0 to 2"),
    ({"prompt": "x", "temperature": False}, "'temperature' must be a number from 0 to 2"),
    ({"prompt": "x", "top_p": 0}, "'top_p' must be a number in (0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "'top_p' must be a number in (0, 1]"),
    ({"prompt": "x", "top_k": -1}, "'top_k' must be an integer from 0 (off) to 1073741824"),
    ({"prompt": "x", "top_k": 2.5}, "'top_k' must be an integer from 0 (off) to 1073741824"),
    ({"prompt": "x", "seed": -1}, "'seed' must be an integer in [0, 2**63)"),
    ({"prompt": "x", "seed": 2**63}, "'seed' must be an integer in [0, 2**63)"),
    ({"prompt": "x", "seed": "7"}, "'seed' must be an integer in [0, 2**63)"),
    ({"prompt": "x", "stop": 5}, "'stop' must be a string or a list of strings and token id lists"),
    ({"prompt": "x", "stop": ""}, "'stop' is an empty string"),
    ({"prompt": "x", "stop": ["a", ""]}, "'stop[1]' is an empty string"),
    ({"prompt": "x", "stop": [5]}, "'stop[0]' must be a string or a list of token ids"),
    ({"prompt": "x", "stop": [[]]}, "'stop[0]' must be a non-empty list of token ids"),
    ({"prompt": "x", "stop": [[1, 900]]}, "'stop[0][1]' = 900 is out of range [0, 512)"),
    # the wire's bounds (wire/limits.py), refused here rather than by the router
    ({"prompt": "x", "top_k": 2**30 + 1}, "'top_k' must be an integer from 0 (off) to 1073741824"),
    ({"prompt": "x", "top_k": 2**64}, "'top_k' must be an integer from 0 (off) to 1073741824"),
    ({"prompt": "x", "temperature": 1e5}, "'temperature' must be a number from 0 to 2"),
    ({"prompt": "x", "temperature": 9}, "'temperature' must be a number from 0 to 2"),  # as over HTTP
    ({"prompt": "x", "stop": [[1]] * 65}, "'stop' holds at most 64 stop sequences"),
    ({"prompt": "x", "stop": [[1] * 65]}, "'stop[0]' is 65 tokens; a stop sequence is at most 64"),
    ({"prompt": "x", "seed": 2**64}, "'seed' must be an integer in [0, 2**63)"),
])
def test_jsonl_errors(tok, obj, message):
    err = error_of(jsonl, tok, {"id": "q", **obj}, line_no=9)
    assert str(err) == message
    assert err.req_id == "q"


def test_jsonl_error_without_id_uses_line_number(tok):
    err = error_of(jsonl, tok, {"prompt": "x", "top_k": -1}, line_no=11)
    assert err.req_id == "11"


@pytest.mark.parametrize("bad_id", [True, "", 1.5, ["a"]])
def test_jsonl_bad_id(tok, bad_id):
    err = error_of(jsonl, tok, {"id": bad_id, "prompt": "x"}, line_no=5)
    assert str(err) == "'id' must be a non-empty string or an integer"
    assert err.req_id == "5"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x",}', "invalid JSON: Expecting property name enclosed in double quotes: "
                         "line 1 column 16 (char 15)"),
    ("not json", "invalid JSON: Expecting value: line 1 column 1 (char 0)"),
    ('{"prompt": "x", "temperature": NaN}', "invalid JSON: NaN is not valid JSON"),
    ('{"prompt": "x", "top_p": Infinity}', "invalid JSON: Infinity is not valid JSON"),
    ('["x"]', "expected a JSON object, got list"),
    ('"x"', "expected a JSON object, got str"),
    ("  ", "empty line"),
])
def test_jsonl_invalid(tok, line, message):
    err = error_of(jsonl, tok, line, line_no=6)
    assert str(err) == message
    assert err.req_id == "6"


@pytest.mark.parametrize("line, message", [
    ('{"id": 5, "prompt": "a\\ud800b"}', "invalid JSON: a string holds a lone surrogate (not valid Unicode)"),
    ('{"id": "\\udfff", "prompt": "x"}', "invalid JSON: a string holds a lone surrogate (not valid Unicode)"),
    ('{"prompt": "x", "stop": ' + "[" * 1000 + "]" * 1000 + "}", "invalid JSON: nested deeper than 32 levels"),
    ('{"prompt": "x", "stop": ' + "[" * 100000 + "]" * 100000 + "}", "invalid JSON: nested deeper than 32 levels"),
    ('{"id": "' + "i" * 300 + '", "prompt": "x"}', "'id' is longer than 256 characters"),
])
def test_jsonl_text_the_wire_cannot_carry(tok, line, message):
    """Each is an error record of its own request (no traceback, no crash of ingest)."""
    err = error_of(jsonl, tok, line, line_no=3)
    assert (str(err), err.req_id) == (message, "5" if line.startswith('{"id": 5') else "3")


@pytest.mark.parametrize("line, message", [
    ('{"id": "surrogate", "prompt": "a\\ud800b"}', "lone surrogate"),
    ('{"prompt": "x", "temperature": NaN, "id": "nan"}', "NaN is not valid JSON"),
    ('{"id": "inf", "prompt": "x", "top_p": -Infinity}', "Infinity is not valid JSON"),
    ('{"prompt": "x", "id": "deep", "stop": ' + "[" * 40 + "]" * 40 + "}", "nested deeper than 32"),
    ('{"prompt": "x", "stop": ' + "[" * 100000 + "]" * 100000 + ', "id": "deeper"}', "nested deeper than 32"),
    ('{"id": "digits", "prompt": "x", "seed": ' + "7" * 5000 + "}", "digits"),
    ('{"id": 42, "prompt": "x", "seed": ' + "7" * 5000 + "}", "digits"),
], ids=["surrogate", "nan", "infinity", "nested", "nested-100k", "digits", "digits-int-id"])
def test_a_line_refused_as_json_keeps_its_readable_id(tok, line, message):
    err = error_of(jsonl, tok, line, line_no=9)
    assert message in str(err) and str(err).startswith("invalid JSON")
    want = json.loads(line.split('"id": ')[1].split(",")[0].rstrip("}")) if '"id": ' in line else None
    assert err.req_id == str(want)


@pytest.mark.parametrize("line", [
    '{"id": "\\udfff", "prompt": "x", "top_k": NaN}',      # the id itself is not valid Unicode
    '{"prompt": {"id": "inner"}, "top_k": NaN}',           # not a top-level id
    '{"id": "' + "i" * 300 + '", "top_k": NaN}',           # longer than an id may be
    '[{"id": "x"}, NaN]',
], ids=["surrogate-id", "inner-id", "long-id", "not-an-object"])
def test_an_unreadable_id_leaves_the_line_number(tok, line):
    assert error_of(jsonl, tok, line, line_no=9).req_id == "9"


def test_check_json_looks_into_lists_of_numbers_only_for_depth():
    from qmigrate.ingest.json_checks import MAX_JSON_DEPTH, check_json
    deep, empty = [1, 2], []
    for _ in range(MAX_JSON_DEPTH - 2):
        deep = [deep]
    for _ in range(MAX_JSON_DEPTH - 1):
        empty = [empty]
    check_json(deep)  # the numbers sit at the limit
    check_json(empty)
    for bad, why in [([deep], "nested"), ([1, 2.5, None, True, "a\ud800"], "surrogate"),
                     ({"k": [3] * 100 + [{"\udfff": 1}]}, "surrogate")]:
        with pytest.raises(ValueError, match=why):
            check_json(bad)


def test_ids_are_checked_whole_and_the_first_bad_one_named(tok):
    ok = jsonl(tok, {"prompt_ids": [5, 6, 7]})
    assert ok.prompt_ids == [5, 6, 7]
    for ids, message in [([5, True, 7], "'prompt_ids[1]' must be an integer token id, got true"),
                         ([5, 6, -1, 10**6], "'prompt_ids[2]' = -1 is out of range"),
                         ([5, 2.0], "'prompt_ids[1]' must be an integer token id, got 2.0")]:
        assert str(error_of(jsonl, tok, {"prompt_ids": ids})).startswith(message)


def test_a_pair_of_surrogates_is_one_character(tok):
    assert jsonl(tok, '{"prompt": "a\\ud83d\\ude00"}').prompt_ids == tok.encode("a\U0001f600")


def test_an_accepted_request_passes_the_codec(tok):
    """What ingest accepts, the router decodes: parse_request ends with the codec's own check."""
    from qmigrate.ingest.prompts import check_prompt
    p = jsonl(tok, {"prompt": "x", "top_k": 2**30, "stop": [[1] * 64] * 64, "seed": 2**63 - 1})
    assert check_prompt(p) is p
    p.top_k = 2**30 + 1
    with pytest.raises(PromptError, match="protocol's bounds.*top_k"):
        check_prompt(p)


def test_jsonl_too_long_names_request(tok):
    err = error_of(jsonl, tok, {"id": "big", "prompt_ids": [3] * 200})
    assert str(err) == "prompt is 200 tokens; the model's context is 64"
    assert err.req_id == "big"


def test_vocab_size_override(tok):
    err = error_of(jsonl, tok, {"prompt_ids": [100]}, vocab_size=100)
    assert str(err) == "'prompt_ids[0]' = 100 is out of range [0, 100)"


def test_unknown_mode(tok):
    with pytest.raises(ValueError, match="unknown input mode"):
        parse_line("x", mode="csv", line_no=1, tokenizer=tok, max_context=8,
                   defaults=Defaults(), eos_ids=[])


def test_sampling_controls_are_taken_and_travel_in_the_spec(tok):
    from qmigrate.ingest.prompts import to_spec
    from qmigrate.router.records import Seq
    from qmigrate.wire import protocol as P
    p = jsonl(tok, {"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                    "min_p": 0.1, "logit_bias": {"5": 10, "7": -100, "9": 0}, "stop_token_ids": [11, 12],
                    "min_tokens": 2})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -1.0, 1.2, 0.1)
    assert p.logit_bias == {5: 10.0, 7: -100.0} and p.stop_token_ids == [11, 12]
    spec = codec.decode(codec.encode(P.Submit([to_spec(p, 3, 0, [1])]))).seqs[0]
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty, spec.min_p) == \
        (0.5, -1.0, 1.2, 0.1)
    assert (spec.bias_ids, spec.bias_values, spec.eos_ids) == ([5, 7], [10.0, -100.0], [1, 11, 12])
    # stop_token_ids end the output with ignore_eos too (only EOS is ignored)
    ignoring = jsonl(tok, {"prompt": "x", "stop_token_ids": [11], "ignore_eos": True})
    assert to_spec(ignoring, 3, 0, [1]).eos_ids == [11]
    # the router's full form for another worker keeps them, with the ids as they stand
    moved = Seq(spec, P.unpack_ids(spec.token_ids).tolist() + [40, 41]).respec("tcp://w2", 9)
    assert moved.ids.tolist()[-2:] == [40, 41] and (moved.kv_from, moved.transfer_id) == ("tcp://w2", 9)
    assert (moved.bias_ids, moved.presence_penalty, moved.min_p, moved.eos_ids) == ([5, 7], 0.5, 0.1, [1, 11, 12])


@pytest.mark.parametrize("obj, message", [
    ({"presence_penalty": 2.5}, "'presence_penalty' must be a number from -2 to 2"),
    ({"frequency_penalty": "1"}, "'frequency_penalty' must be a number from -2 to 2"),
    ({"repetition_penalty": 0}, "'repetition_penalty' must be a number from 0.01 to 100"),
    ({"min_p": 1.5}, "'min_p' must be a number from 0 to 1"),
    ({"logit_bias": [1]}, "'logit_bias' must be an object of at most 1024"),
    ({"logit_bias": {"x": 1}}, "'logit_bias' key 'x' is not a token id in [0, 512)"),
    ({"logit_bias": {"600": 1}}, "'logit_bias' key '600' is not a token id in [0, 512)"),
    ({"logit_bias": {"5": 101}}, "'logit_bias[5]' must be a number from -100 to 100"),
    ({"stop_token_ids": [3, 900]}, "'stop_token_ids[1]' = 900 is out of range [0, 512)"),
    ({"stop_token_ids": list(range(3, 70))}, "'stop_token_ids' holds at most"),
])
def test_bad_sampling_controls(tok, obj, message):
    assert str(error_of(jsonl, tok, {"prompt": "x", **obj})).startswith(message)
