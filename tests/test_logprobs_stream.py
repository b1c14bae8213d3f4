"""A stream's logprobs written straight as JSON text (logprobs_api.ChoiceExtras.fresh_json and
streams.LogprobsFrame) say what the dicts of the same tokens say, event by event."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from qmigrate.ingest.logprobs_api import ChoiceExtras, TokenText
from qmigrate.ingest.openai_api import ApiRequest
from qmigrate.ingest.openai_replies import chunk
from qmigrate.ingest.prompts import Prompt
from qmigrate.ingest.streams import MARK, LogprobsFrame, sse


class Letters:
    """A tokenizer whose ids 0-39 decode to 20 texts (two ids a text), some not ASCII."""

    def decode(self, ids):
        return ["a", " b", "é", "\"q\"", "\\", "日本", "\n", "", "x y", "😀"][ids[0] % 10] + "!" * (ids[0] % 20 // 10)


def _entries(rng, n: int, width: int) -> list:
    out = []
    for _ in range(n):
        token = int(rng.integers(0, 40))
        if rng.random() < 0.15:
            out.append((token, None, None))   # a resent token: no logprobs
            continue
        values = rng.normal(-3, 2, 1 + width).astype(np.float32)
        values[0] = [values[0], -np.inf, np.nan][int(rng.integers(0, 3)) if rng.random() < 0.3 else 0]
        ids = rng.integers(0, 40, width)
        if rng.random() < 0.3:
            ids[-1] = -1   # past what was computed
        if rng.random() < 0.2:
            values[1] = -np.inf
        out.append((token, values.tolist(), ids.tolist()))
    return out


def _prompt() -> Prompt:
    return Prompt("r", [1, 2, 3], 16, 1.0, 1.0, 0, None, [])


def _request(kind: str, stream: bool, top: int) -> ApiRequest:
    return ApiRequest(kind, "m", [_prompt()], stream=stream, logprobs=top)


def _same(a, b) -> bool:
    """JSON values equal, NaN-free (a NaN logprob is null on both sides)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and not math.isnan(a) and a == b
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("top", [0, 2, 5])
def test_streamed_logprobs_json_says_what_the_dicts_say(kind, top):
    rng = np.random.default_rng(top + (kind == "chat"))
    text = TokenText(Letters())
    streamed = ChoiceExtras(_request(kind, True, top), 0, text)
    built = ChoiceExtras(_request(kind, False, top), 0, text)
    frame = LogprobsFrame(chunk(_request(kind, True, top), "id-1", 7, MARK))
    for step in range(12):
        entries = _entries(rng, int(rng.integers(1, 4)), max(top, 1))
        streamed.push(entries, None)
        built.push(entries, None)
        fast = streamed.fresh_json()
        assert fast is not None
        want = built.fresh()
        assert _same(json.loads(fast), json.loads(json.dumps(want)))
        piece = f"t{step}\"é"
        event = frame(piece, fast)
        reference = sse(chunk(_request(kind, False, top), "id-1", 7, piece, extra=_Fixed(want)))
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert _same(json.loads(event[6:]), json.loads(reference[6:]))


class _Fixed:
    """A ChoiceExtras stand-in whose fresh() is given."""

    def __init__(self, fresh) -> None:
        self.value = fresh

    def fresh(self):
        return self.value

    def with_echo(self, text):
        return text

    def take_prompt(self):
        return None


def test_a_stream_with_echo_or_prompt_logprobs_keeps_the_dicts():
    text = TokenText(Letters())
    for req in (ApiRequest("completion", "m", [_prompt()], stream=True, logprobs=2, echo=True,
                           prompt_texts=["abc"]),
                ApiRequest("completion", "m", [_prompt()], stream=True, logprobs=2, prompt_logprobs=1)):
        extra = ChoiceExtras(req, 0, text)
        assert extra.fresh_json() is None


def test_a_logprob_is_written_with_a_float32s_digits_and_minus_infinity_as_minus_9999():
    """Every value is a float32 (computed so on the device): nine significant digits give it
    back exactly; a JSON number each time (never a bare integer, nor inf)."""
    from qmigrate.ingest.logprobs_api import _num, _text, _value
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(-4, 3, 2000), -rng.exponential(1e-6, 200), [0.0, -1.0, -9999.0]])
    for v in values.astype(np.float32).tolist():
        text = _text(v)
        assert np.float32(float(text)) == np.float32(v) and len(text.lstrip("-")) <= 16
        assert isinstance(json.loads(text), float) and _value(v) == float(text) and _num(v) == text
    assert _text(float("-inf")) == "-9999.0" and _value(float("-inf")) == -9999.0
    assert _num(float("nan")) == "null" and _value(float("nan")) is None


def test_stdin_jsonl_writes_logprobs_as_the_http_api_does_never_infinity():
    """A forbidden alternative (minus infinity: the grammar's mask, logit_bias) in a JSONL final
    record is -9999.0, not JSON's invalid -Infinity; every value as the HTTP API writes it."""
    from qmigrate.detokenizer.formats import _logprob_record
    from qmigrate.ingest.logprobs_api import _value

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))

    values = np.array([-0.1, -0.5, -np.inf], dtype=np.float32)
    record = strict(json.dumps(_logprob_record(5, values, np.array([3, 4]))))
    assert record == {"token_id": 5, "logprob": _value(values[0]), "top_logprobs": [[3, -0.5], [4, -9999.0]]}
    prompt = strict(json.dumps(_logprob_record(None, np.array([-np.inf, 7, -1.25, -np.inf], dtype=np.float32),
                                               np.array([2, -1]))))
    assert prompt == {"logprob": -9999.0, "rank": 7, "top_logprobs": [[2, -1.25]]}
