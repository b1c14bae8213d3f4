"""`Finish`: how a sequence stands after a step and how a request ended, as a small integer
on the wire, with its text and OpenAI reasons and the codes each message may carry."""

from __future__ import annotations

import enum

import numpy as np

class Finish(enum.IntEnum):
    """How a sequence stands after a step, and how a request ended. In a worker's results NONE
    runs on, NEED_IDS asks for a resend, the others end it; CANCELLED (its client went away)
    is set by the detokenizer and travels only to ingest."""

    NONE = 0
    EOS = 1
    LENGTH = 2
    STOP = 3
    NEED_IDS = 4
    ERROR = 5       # the worker cannot run this sequence at all (bad ids, too long)
    CANCELLED = 100

    @property
    def reason(self) -> str:
        """The text reason the detokenizer prints ("" for a code that ends nothing)."""
        return _REASONS.get(self, "")

    @classmethod
    def from_reason(cls, reason: str) -> "Finish":
        """The code of a text reason; an unknown reason is an ERROR."""
        return _BY_REASON.get(reason, cls.ERROR)

    @property
    def openai_reason(self) -> str | None:
        """The OpenAI API's finish_reason, or None where the request did not end well."""
        return _OPENAI_REASONS.get(self)

    @property
    def is_finished(self) -> bool:
        return self in _REASONS


_REASONS = {Finish.EOS: "eos", Finish.LENGTH: "length", Finish.STOP: "stop", Finish.ERROR: "error",
            Finish.CANCELLED: "cancelled"}
_BY_REASON = {text: code for code, text in _REASONS.items()}
_OPENAI_REASONS = {Finish.EOS: "stop", Finish.LENGTH: "length", Finish.STOP: "stop"}
STEP_CODES = frozenset(int(f) for f in Finish if f is not Finish.CANCELLED)   # a worker's results
_IS_STEP_CODE = np.isin(np.arange(256), sorted(STEP_CODES))   # by uint8 value: one lookup per row
REPLY_CODES = frozenset(int(f) for f in Finish if f is not Finish.NEED_IDS)   # detokenizer to ingest


def step_codes_ok(codes: np.ndarray) -> bool:
    """Every code of `codes` (uint8) is one a worker's results may carry."""
    return bool(_IS_STEP_CODE[codes].all())
