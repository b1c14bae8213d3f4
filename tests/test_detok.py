import json

import pytest

from qmigrate.detokenizer.decoder import IncrementalDecoder
from qmigrate.detokenizer.formats import JsonlSink, TextSink, make_sink
from tokenizer_util import build_sentencepiece_tokenizer, build_tokenizer

TEXTS = [
    "Hello world, this is plain ASCII text.",
    "Café naïve résumé über Zürich.",
    "東京は日本の首都です。我喜欢学习新的语言。",
    "Emoji 🙂 and 🚀 and 😀🦄 mixed with text 🎉!",
    "Line one\nline two\n\nline four",
    "한국어 ❤️ São Paulo 🦄",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def gen_ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def reference(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def stream(decoder, ids, chunk=1):
    deltas = [decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(decoder.finish())
    return deltas


def test_emoji_is_split_across_tokens(tok):
    for ch in ["😀", "🦄", "東"]:
        ids = gen_ids(tok, ch)
        assert len(ids) >= 2, (ch, ids)
        assert all("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_join_to_full_decode(tok, text, chunk):
    ids = gen_ids(tok, text)
    deltas = stream(IncrementalDecoder(tok), ids, chunk)
    assert "".join(deltas) == reference(tok, ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_split_character_is_held_back(tok):
    ids = gen_ids(tok, "a😀")
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([i]) for i in ids]
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "😀"
    assert dec.finish() == ""


@pytest.mark.parametrize("prompt", ["Tell me about", "東京は", "Go 🚀", "🦄"])
@pytest.mark.parametrize("text", TEXTS)
def test_primed_on_prompt(tok, prompt, text):
    prompt_ids = tok.encode(prompt)
    ids = gen_ids(tok, " " + text)
    deltas = stream(IncrementalDecoder(tok, prompt_ids), ids)
    assert "".join(deltas) == reference(tok, ids)


def test_prime_never_starts_mid_character(tok):
    # Five ids back from the end lands inside the multi-byte characters here.
    prompt_ids = tok.encode("x 😀🦄東京")
    assert "\ufffd" in tok.decode(prompt_ids[-5:])
    dec = IncrementalDecoder(tok, prompt_ids)
    primed = tok.decode(dec._ids)
    assert primed and not primed.startswith("\ufffd") and "東京".endswith(primed[-2:])
    ids = gen_ids(tok, "ok 🎉")
    assert "".join(stream(dec, ids)) == "ok 🎉"


def test_prompt_ending_mid_character(tok):
    # The generated ids complete the prompt's last character; a full decode of the
    # generated ids alone shows the orphan bytes as U+FFFD.
    emoji_ids = gen_ids(tok, "hi 😀")
    prompt_ids, ids = emoji_ids[:-1], emoji_ids[-1:] + gen_ids(tok, " done")
    assert reference(tok, ids) == "\ufffd done"
    assert "".join(stream(IncrementalDecoder(tok, prompt_ids), ids)) == "\ufffd done"


def test_special_tokens_skipped(tok):
    ids = gen_ids(tok, "one") + [tok.eos_token_id] + gen_ids(tok, " two")
    assert "".join(stream(IncrementalDecoder(tok), ids)) == "one two"


def test_incomplete_character_flushed_at_finish(tok):
    ids = gen_ids(tok, "ab😀")[:-1]
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push([i]) for i in ids) == "ab"
    assert dec.finish() == reference(tok, ids)[2:]
    assert dec.finish() == ""


@pytest.fixture(scope="module")
def sp_tok():
    return build_sentencepiece_tokenizer()


def test_sentencepiece_uses_byte_fallback(sp_tok):
    ids = sp_tok.encode("🦄", add_special_tokens=False)
    assert sp_tok.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x84>"]


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_unprimed_matches_decode(sp_tok, text):
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert "".join(stream(IncrementalDecoder(sp_tok), ids)) == reference(sp_tok, ids) == text


@pytest.mark.parametrize("prompt", ["Tell me about", "東京", "a 🦄", "Go 🚀 now"])
@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_primed_matches_full_decode(sp_tok, prompt, text):
    # The first generated word keeps its leading space, as in a decode of the whole stream.
    prompt_ids = sp_tok.encode(prompt)
    ids = sp_tok.encode(text, add_special_tokens=False)
    full = reference(sp_tok, prompt_ids + ids)
    expected = full[len(reference(sp_tok, prompt_ids)):]
    assert expected == " " + text
    assert "".join(stream(IncrementalDecoder(sp_tok, prompt_ids), ids)) == expected


# ---- sinks ----


def records(lines):
    return [json.loads(line) for line in lines]


def test_jsonl_records(tok):
    out = []
    sink = JsonlSink(tok, out.append)
    ids = gen_ids(tok, "Hi 😀 there")
    sink.start(3, "req-a", prompt_ids=tok.encode("Say"))
    sink.tokens(3, 0, ids[:2])
    sink.tokens(3, 2, ids[2:])
    assert sink.num_done == 0 and sink.num_active == 1
    sink.finish(3, "length")
    sink.error("req-b", "empty prompt")
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in out)
    recs = records(out)
    deltas, final, err = recs[:-2], recs[-2], recs[-1]
    assert all(set(r) == {"id", "delta", "done"} and r["done"] is False for r in deltas)
    assert all(r["id"] == "req-a" and r["delta"] for r in deltas)
    assert final == {"id": "req-a", "text": "Hi 😀 there", "token_ids": ids,
                     "finish_reason": "length", "done": True}
    assert "".join(r["delta"] for r in deltas) == final["text"]
    assert err == {"id": "req-b", "error": "empty prompt", "done": True}
    assert sink.num_done == 2 and sink.num_errors == 1 and sink.num_active == 0
    assert "😀" in out[-2]  # not escaped


def test_failed_requests_are_counted_for_the_exit_status(tok):
    """sim exits non-zero when any request failed: refused by ingest, or ended by a worker's
    error; those that end by EOS, length or a stop did not fail."""
    sink = JsonlSink(tok, [].append)
    for seq_id, reason in enumerate(["eos", "length", "stop", "error"]):
        sink.start(seq_id, f"r{seq_id}", prompt_ids=[])
        sink.tokens(seq_id, 0, gen_ids(tok, "Hi"))
        sink.finish(seq_id, reason)
    assert sink.num_done == 4 and sink.num_failed == 1
    sink.error("bad", "empty prompt")
    assert sink.num_done == 5 and sink.num_failed == 2


def test_duplicate_tokens_printed_once(tok):
    out = []
    sink = JsonlSink(tok, out.append)
    ids = gen_ids(tok, "The quick brown fox")
    sink.start(1, "r")
    sink.tokens(1, 0, ids[:3])
    sink.tokens(1, 0, ids[:3])  # retried batch
    sink.tokens(1, 1, ids[1:])  # overlaps what was seen
    sink.tokens(1, 0, ids)
    sink.finish(1, "stop")
    sink.finish(1, "stop")
    sink.tokens(1, 0, ids)  # after finish
    recs = records(out)
    assert recs[-1]["token_ids"] == ids
    assert recs[-1]["text"] == "The quick brown fox"
    assert "".join(r.get("delta", "") for r in recs) == "The quick brown fox"
    assert sink.num_done == 1
    assert sink.is_done(1)


def test_gap_is_buffered_until_filled(tok):
    out = []
    sink = JsonlSink(tok, out.append)
    ids = gen_ids(tok, "alpha beta gamma delta")
    assert len(ids) >= 6
    sink.start(1, "r")
    sink.tokens(1, 0, ids[:2])
    n = len(out)
    sink.tokens(1, 4, ids[4:])  # index 2, 3 missing
    assert len(out) == n
    sink.tokens(1, 3, ids[3:4])
    assert len(out) == n
    sink.tokens(1, 2, ids[2:3])
    assert len(out) > n
    sink.finish(1, "length")
    recs = records(out)
    assert recs[-1]["token_ids"] == ids
    assert recs[-1]["text"] == "alpha beta gamma delta"


def test_finish_waits_for_missing_tokens(tok):
    out = []
    sink = JsonlSink(tok, out.append)
    ids = gen_ids(tok, "one two three")
    sink.start(5, "r")
    sink.tokens(5, 1, ids[1:])
    sink.finish(5, "eos", num_tokens=len(ids))
    assert out == [] and sink.num_done == 0
    sink.tokens(5, 0, ids[:1])
    assert sink.num_done == 1
    assert records(out)[-1]["text"] == "one two three"


def test_tokens_past_num_tokens_dropped(tok):
    out = []
    sink = JsonlSink(tok, out.append)
    ids = gen_ids(tok, "one two three")
    sink.start(5, "r")
    sink.tokens(5, 2, ids[2:] + [7, 8])
    sink.finish(5, "length", num_tokens=len(ids))
    sink.tokens(5, len(ids) - 1, ids[-1:] + [9])
    assert out == []
    sink.tokens(5, 0, ids[:2])
    assert records(out)[-1]["token_ids"] == ids
    assert sink.num_dropped_tokens == 2  # 7 and 8; 9 repeats the index of 7


def test_tokens_before_start(tok):
    out = []
    sink = JsonlSink(tok, out.append)
    ids = gen_ids(tok, "early bird")
    sink.tokens(9, 0, ids)
    assert out == []
    sink.start(9, "late")
    sink.finish(9, "length")
    recs = records(out)
    assert recs[-1]["id"] == "late" and recs[-1]["text"] == "early bird"


def test_interleaved_requests_are_separate(tok):
    out = []
    sink = JsonlSink(tok, out.append)
    a, b = gen_ids(tok, "東京は日本"), gen_ids(tok, "Hello 🙂")
    sink.start(1, "a")
    sink.start(2, "b")
    for i in range(max(len(a), len(b))):
        if i < len(a):
            sink.tokens(1, i, a[i : i + 1])
        if i < len(b):
            sink.tokens(2, i, b[i : i + 1])
    sink.finish(2, "eos")
    sink.finish(1, "length")
    recs = records(out)
    for rid, text in [("a", "東京は日本"), ("b", "Hello 🙂")]:
        mine = [r for r in recs if r["id"] == rid]
        assert "".join(r.get("delta", "") for r in mine) == text
        assert mine[-1]["text"] == text


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_text_lines_and_done(tok):
    out = []
    sink = TextSink(tok, out.append, clock=Clock())
    ids = gen_ids(tok, "Line one\nline two\n\nend")
    sink.start(1, "7")
    sink.tokens(1, 0, ids)
    sink.finish(1, "length")
    n = len(ids)
    assert "".join(out) == (
        "[7] Line one\n[7] line two\n[7]\n[7] end\n"
        f"[7] <done: length, {n} tokens>\n"
    )


def test_text_long_text_breaks_at_word_boundary(tok):
    out = []
    sink = TextSink(tok, out.append, clock=Clock())
    text = ("The quick brown fox jumps over the lazy dog. " * 4).strip()
    ids = gen_ids(tok, text)
    sink.start(1, "r")
    for i, t in enumerate(ids):
        sink.tokens(1, i, [t])
    sink.finish(1, "stop")
    lines = "".join(out).splitlines()
    assert lines[-1] == f"[r] <done: stop, {len(ids)} tokens>"
    body = [line.removeprefix("[r] ") for line in lines[:-1]]
    assert all(line.startswith("[r] ") for line in lines)
    assert " ".join(body) == text
    assert len(body) >= 2
    assert all(len(chunk) <= 120 for chunk in body)
    assert all(len(chunk) >= 60 for chunk in body[:-1])
    words = set(text.replace(".", "").split())
    assert all(w.strip(".") in words for chunk in body for w in chunk.split())


def test_text_long_word_is_cut(tok):
    out = []
    sink = TextSink(tok, out.append, clock=Clock(), line_chars=10, max_line_chars=20)
    ids = gen_ids(tok, "x" * 45)
    sink.start(1, "r")
    sink.tokens(1, 0, ids)
    sink.finish(1, "length")
    assert out[:3] == ["[r] " + "x" * 20 + "\n", "[r] " + "x" * 20 + "\n", "[r] xxxxx\n"]


def test_text_idle_flush_and_interleaving(tok):
    out = []
    clock = Clock()
    sink = TextSink(tok, out.append, clock=clock)
    sink.start(1, "a")
    sink.start(2, "b")
    sink.tokens(1, 0, gen_ids(tok, "Hello wor"))
    sink.tokens(2, 0, gen_ids(tok, "東京"))
    sink.flush_idle(clock.now + 0.1)
    assert out == []
    clock.now += 0.5
    sink.flush_idle()
    assert out == ["[a] Hello\n", "[b] 東京\n"]
    sink.flush_idle(clock.now + 0.1)
    assert len(out) == 2
    sink.flush_idle(clock.now + 1.0)
    assert out[2:] == ["[a] wor\n"]
    sink.tokens(1, len(gen_ids(tok, "Hello wor")), gen_ids(tok, "ld"))
    sink.finish(1, "eos")
    sink.error("c", "prompt is 900 tokens; the model's context is 512")
    assert out[3:] == [
        "[a] ld\n",
        f"[a] <done: eos, {len(gen_ids(tok, 'Hello wor')) + len(gen_ids(tok, 'ld'))} tokens>\n",
        "[c] error: prompt is 900 tokens; the model's context is 512\n",
    ]
    assert sink.num_done == 2 and sink.num_active == 1


def test_text_one_token_wording(tok):
    out = []
    sink = TextSink(tok, out.append, clock=Clock())
    sink.start(1, "r")
    sink.tokens(1, 0, gen_ids(tok, "x"))
    sink.finish(1, "eos")
    assert out == ["[r] x\n", "[r] <done: eos, 1 token>\n"]


def test_make_sink(tok):
    assert isinstance(make_sink("text", tok, print), TextSink)
    assert isinstance(make_sink("jsonl", tok, print), JsonlSink)
    with pytest.raises(ValueError, match="unknown output mode"):
        make_sink("xml", tok, print)


def test_accepts_int32_arrays(tok):
    import numpy as np

    ids = gen_ids(tok, "Café 🦄")
    dec = IncrementalDecoder(tok, np.asarray(tok.encode("x"), dtype=np.int32))
    assert dec.push(np.asarray([], dtype=np.int32)) == ""
    assert dec.push(np.asarray(ids, dtype=np.int32)) + dec.finish() == "Café 🦄"
    out = []
    sink = JsonlSink(tok, out.append)
    sink.start(1, "r")
    sink.tokens(1, 0, np.asarray(ids, dtype=np.int32))
    sink.finish(1, "length")
    assert json.loads(out[-1])["token_ids"] == ids


def test_text_to_a_pipe_prints_whole_lines_however_the_tokens_come(tok):
    out = []
    clock = Clock()
    sink = make_sink("text", tok, out.append, clock, whole_lines=True)
    text = ("The quick brown fox jumps over the lazy dog. " * 4).strip() + "\nSecond line"
    ids = gen_ids(tok, text)
    sink.start(1, "r")
    for i, t in enumerate(ids):
        sink.tokens(1, i, [t])
        clock.now += 1.0
        assert not sink.is_idle_due(clock.now)
        sink.flush_idle()
    assert out == ["[r] " + text.split("\n")[0] + "\n"]  # the first line, whole, at its newline
    sink.finish(1, "length")
    assert out[1:] == ["[r] Second line\n", f"[r] <done: length, {len(ids)} tokens>\n"]


@pytest.mark.parametrize("which", ["bpe", "sentencepiece"])
def test_the_rust_stream_gives_the_deltas_of_the_python_method(tok, sp_tok, which):
    """A fast tokenizer's pushes go through `tokenizers`' DecodeStream, one id at a time; on
    random ids (split and invalid characters, special tokens, ids past the tokenizer, primed
    or not, pushed one or a few at a time) every delta and the finish equal those of the
    method run from Python on the same ids one at a time."""
    import random
    t = tok if which == "bpe" else sp_tok
    assert IncrementalDecoder(t)._stream is not None   # else this compares the Python path with itself
    r = random.Random(7)
    specials = sorted(set(t.all_special_ids))
    for trial in range(60):
        prompt = [r.randrange(len(t)) for _ in range(r.randint(0, 8))] or None
        ids = [r.choice(specials) if r.random() < 0.05 else r.randrange(len(t) + 3) for _ in range(r.randint(1, 40))]
        fast, slow = IncrementalDecoder(t, prompt), IncrementalDecoder(t, prompt, use_stream=False)
        chunks, i = [], 0
        while i < len(ids):
            n = 1 if trial % 2 else r.randint(1, 3)
            chunks.append(ids[i:i + n])
            i += n
        got = [fast.push(c) for c in chunks] + [fast.finish()]
        want = ["".join(slow.push([i]) for i in c) for c in chunks] + [slow.finish()]
        assert got == want, (prompt, ids)
