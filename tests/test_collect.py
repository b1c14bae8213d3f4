"""Greedy steps copy no sampling parameters; a collect keeps the worker's loop going while
the step runs."""

from __future__ import annotations

import torch

from qmigrate.engine.rows import Pending, StepRow
from qmigrate.engine.engine import Engine
from qmigrate.engine.sampling import SamplingRows, host_arrays, sample

from test_engine import model, tiny  # noqa: F401 (the session's tiny model)


def test_greedy_rows_copy_no_parameters():
    arrays = host_arrays([0.0] * 4, [1.0] * 4, [0] * 4, [7] * 4, [0] * 4)
    rows = SamplingRows.from_arrays(arrays, "cpu")
    assert not rows.is_sampled and rows.temperature is None and rows.seed is None
    logits = torch.randn(4, 50)
    assert sample(logits, rows).tolist() == logits.argmax(-1).tolist()
    hot = SamplingRows.from_arrays(host_arrays([0.0, 0.8, 0.0, 0.0], [1.0] * 4, [0] * 4, [7] * 4, [0] * 4), "cpu")
    assert hot.is_sampled and hot.temperature.tolist() == [0.0, 0.800000011920929, 0.0, 0.0]


class SlowEvent:
    """A step that ends after `polls` queries."""

    def __init__(self, polls: int):
        self.polls, self.synchronized = polls, False

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.synchronized = True


def test_collect_calls_its_hook_while_the_step_runs_and_stops_when_told(model):
    engine = Engine(model, runner="hf", max_kv_tokens=1024, max_model_len=64)
    calls = []
    row = StepRow(1, [3], 0, 0)
    pending = Pending([row], [0], {1: 0}, tokens=torch.tensor([5]), event=SlowEvent(10))
    assert engine.collect(pending, lambda: calls.append(1) or True) == [5]
    assert len(calls) == 10 and pending.event.synchronized
    calls.clear()
    pending = Pending([row], [0], {1: 0}, tokens=torch.tensor([6]), event=SlowEvent(10))
    assert engine.collect(pending, lambda: calls.append(1) or len(calls) < 3) == [6]
    assert len(calls) == 3   # it said False: the rest is a plain wait
