"""What an offline caller gives and gets: `SamplingParams` in (vLLM's names), `RequestOutput`
out. Imports no torch: `from qmigrate import SamplingParams` stays cheap.

A SamplingParams is checked when it is made, by the same code that checks a JSONL or HTTP
request (`ingest/prompts.parse_request`); what depends on the model (a stop string's length
in tokens, token ids against the vocabulary, the context) is checked again in `LLM.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qmigrate.ingest.prompts import Defaults, PromptError, parse_request

_DEFAULTS = Defaults()
_ANY_ID = (1 << 31) - 1   # ids are checked against the vocabulary once there is a model


class _NoModel:
    """Stands in for a tokenizer while SamplingParams are checked without a model: a stop
    string counts as one token until the model's tokenizer says how many it is."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0]


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = _DEFAULTS.max_new_tokens
    temperature: float = _DEFAULTS.temperature      # 0: greedy
    top_p: float = _DEFAULTS.top_p
    top_k: int = _DEFAULTS.top_k                    # 0: off
    seed: int | None = None                         # None: one is drawn per request
    stop: str | list[str | list[int]] | None = None  # strings and/or token-id sequences
    stop_token_ids: list[int] | None = None         # each id ends the output, as a stop does
    ignore_eos: bool = False
    min_tokens: int = 0                             # neither EOS nor a stop ends it sooner
    detokenize: bool = True                         # False: token ids only, no text

    def __post_init__(self):
        if not isinstance(self.detokenize, bool):
            raise ValueError("detokenize must be a boolean")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        try:
            parse_request({"prompt_ids": [0], **self.request_fields()}, "", tokenizer=_NoModel(),
                          max_context=1 << 62, vocab_size=_ANY_ID)
        except PromptError as exc:
            raise ValueError(message_of(exc)) from None

    def request_fields(self) -> dict:
        """The keys of a JSONL request (ingest/prompts.py) these parameters stand for."""
        stop = self.stop if self.stop is not None else []
        if self.stop_token_ids:
            stop = (stop if isinstance(stop, list) else [stop]) + [[t] for t in self.stop_token_ids]
        return {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": stop, "ignore_eos": self.ignore_eos,
                "min_tokens": self.min_tokens}

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if isinstance(s, str)]


def message_of(exc: PromptError) -> str:
    """The request checker's message in this API's names."""
    return exc.message.replace("max_new_tokens", "max_tokens")


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str                      # "" with detokenize=False; a stop string it ended on is cut off
    token_ids: list[int]           # every generated token, those of a stop sequence included
    finish_reason: str | None      # "stop" (EOS or a stop sequence) or "length", as the OpenAI API says


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None             # None for a prompt given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0     # prompt positions found in the prefix cache
