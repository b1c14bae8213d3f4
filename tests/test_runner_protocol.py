"""The `Runner` protocol is everything the engine asks of a runner: every runner (the graph
runner, the transformers runner, rank 0 of a tensor-parallel group) has all of it, and an
engine whose runner has nothing else runs steps and moves KV as before."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qmigrate.engine.engine import Engine
from qmigrate.engine.parallel.lockstep import Leader
from qmigrate.engine.rows import StepRow
from qmigrate.engine.runners.graph import GraphRunner
from qmigrate.engine.runners.hf import HFRunner
from qmigrate.engine.runners.protocol import Runner

RUNNERS = (GraphRunner, HFRunner, Leader)


def protocol_members() -> tuple[set[str], dict[str, inspect.Signature]]:
    """(attributes, methods with their signatures) the protocol declares."""
    attributes = set(Runner.__annotations__)
    methods = {name: inspect.signature(fn) for name, fn in vars(Runner).items()
               if inspect.isfunction(fn) and not name.startswith("_")}
    return attributes, methods


def test_the_protocol_has_kv_moves():
    attributes, methods = protocol_members()
    assert attributes == {"name", "can_feed"}
    assert set(methods) == {"attach", "forward", "eager_sizes", "export_kv", "import_kv"}


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
def test_every_runner_has_every_member_of_the_protocol(cls):
    attributes, methods = protocol_members()
    for name in attributes:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
    for name, want in methods.items():
        got = getattr(cls, name, None)
        assert callable(got), f"{cls.__name__} lacks {name}()"
        assert list(inspect.signature(got).parameters) == list(want.parameters), f"{cls.__name__}.{name}"
    assert "__getattr__" not in vars(cls)   # nothing reaches past the protocol


def protocol_only(inner):
    """A runner that is the protocol and nothing else (no other attribute can be read from
    it), delegating to `inner` and recording which members were called."""
    attributes, methods = protocol_members()
    body = {"__slots__": ("inner", "calls")}
    for name in attributes:
        body[name] = property(lambda self, name=name: getattr(self.inner, name))
    for name in methods:
        def call(self, *args, _name=name, **kw):
            self.calls.append(_name)
            return getattr(self.inner, _name)(*args, **kw)
        body[name] = call
    wrapper = type("ProtocolOnly", (), body)()
    wrapper.inner, wrapper.calls = inner, []
    return wrapper


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def make(model, wrapped: bool) -> Engine:
    engine = Engine(model, runner="hf", max_kv_tokens=1024, block_size=4)
    if wrapped:
        engine.runner = protocol_only(engine.runner)
        assert isinstance(engine.runner, Runner)
        assert not hasattr(engine.runner, "pool")
    return engine


def decode(engine: Engine, seq_id: int, ids: list[int], start: int, num_new: int) -> list[int]:
    """Greedy tokens of one sequence: a step from `start` (its KV before it is here), then decode steps."""
    out, pending = [], engine.launch([StepRow(seq_id, ids[start:], start, 0)])
    pos = len(ids)
    for i in range(1, num_new):
        nxt = engine.launch([StepRow(seq_id, [], pos, i)], after=pending)
        out += engine.collect(pending)
        pending, pos = nxt, pos + 1
    return out + engine.collect(pending)


def test_an_engine_runs_and_moves_kv_through_the_protocol_alone(model):
    prompt = [5 + (7 * i) % 150 for i in range(23)]
    reference = make(model, wrapped=False)
    want = decode(reference, 1, prompt, 0, 8)

    first, second = make(model, wrapped=True), make(model, wrapped=True)
    assert decode(first, 1, prompt, 0, 4) == want[:4]
    assert first.step([StepRow(2, prompt[:20] + [9], 0, 0)]) == reference.step([StepRow(2, prompt[:20] + [9], 0, 0)])
    so_far = prompt + want[:3]                 # the 4th token is sampled, not in the KV yet
    kv = first.export_kv(1)
    assert kv.shape[2] == len(so_far)
    assert second.import_kv(1, kv)
    assert decode(second, 1, so_far + [want[3]], len(so_far), 4) == want[4:]
    assert {"forward", "export_kv"} <= set(first.runner.calls)   # (attach ran before the wrapping)
    assert "import_kv" in second.runner.calls
