"""A step's host arrays through page-locked memory (engine/staging.py), greedy steps that copy
no sampling parameters, and a collect that keeps the worker's loop going while it waits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qmigrate.engine.rows import Pending, StepRow
from qmigrate.engine.runner import Engine
from qmigrate.engine.sampling import SamplingRows, host_arrays, sample
from qmigrate.engine.staging import Stage

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_on_the_cpu_a_put_is_the_array_itself():
    stage = Stage(torch.device("cpu"))
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    t = stage.put(a)
    assert t.dtype == torch.int32 and t.shape == (3, 4) and t.tolist() == a.tolist()
    stage.next_step()
    assert not stage.slots and stage.to_device(a).device.type == "cpu"


def test_greedy_rows_copy_no_parameters():
    arrays = host_arrays([0.0] * 4, [1.0] * 4, [0] * 4, [7] * 4, [0] * 4)

    def refuse(a):
        raise AssertionError("a greedy step copied its sampling parameters")
    rows = SamplingRows.from_arrays(arrays, "cpu", refuse)
    assert not rows.is_sampled and rows.temperature is None
    logits = torch.randn(4, 50)
    assert sample(logits, rows).tolist() == logits.argmax(-1).tolist()
    copied = []
    hot = SamplingRows.from_arrays(host_arrays([0.0, 0.8, 0.0, 0.0], [1.0] * 4, [0] * 4, [7] * 4, [0] * 4), "cpu",
                                   lambda a: copied.append(a) or torch.from_numpy(a))
    assert hot.is_sampled and len(copied) == 5


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
    engine = Engine(model, runner="hf", max_kv_tokens=1024, max_len=64)
    calls = []
    row = StepRow(1, [3], 0, 0)
    pending = Pending([row], [0], {1: 0}, tokens=torch.tensor([5]), event=SlowEvent(10))
    assert engine.collect(pending, lambda: calls.append(1) or True) == [5]
    assert len(calls) == 10 and pending.event.synchronized
    calls.clear()
    pending = Pending([row], [0], {1: 0}, tokens=torch.tensor([6]), event=SlowEvent(10))
    assert engine.collect(pending, lambda: calls.append(1) or len(calls) < 3) == [6]
    assert len(calls) == 3   # it said False: the rest is a plain wait


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from qmigrate.engine.builders import build_tiny_model
    from qmigrate.engine.loading import load_model
    return load_model(build_tiny_model(tmp_path_factory.mktemp("staging") / "tiny"), "cpu")[0]


@cuda
@pytest.mark.gpu
def test_pinned_slots_are_not_written_before_their_copies_ran():
    stage = Stage(torch.device("cuda"), slot_bytes=1 << 12, num_slots=2)
    outs, want = [], []
    for step in range(8):
        stage.next_step()
        torch.cuda._sleep(2_000_000)   # the device is busy: the copies below wait behind it
        for k, dtype in enumerate((np.int64, np.int32, np.float32)):
            a = (np.arange(100) * (step + 1) + k).astype(dtype)
            outs.append(stage.to_device(a))
            want.append(a)
        assert stage.put(np.zeros(600, dtype=np.int64)).is_pinned()   # no room left: memory of its own
    torch.cuda.synchronize()
    assert stage.num_overflows == 8
    for got, a in zip(outs, want):
        assert got.cpu().numpy().tolist() == a.tolist()
