"""`LLM`: the engine in this process, no router and no sockets, as vLLM's offline API.

    llm = LLM("smollm2")                       # what --model takes; None: the built-in tiny model
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

Engine settings are a worker's (`WorkerConfig`: max_num_seqs, max_num_batched_tokens, runner, device, ...),
given as keyword arguments. Requests are checked as ingest checks them and end by the
worker's rule, so a prompt gives here what it gives through `qmigrate serve`.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import torch

from qmigrate.config import ModelConfig, WorkerConfig
from qmigrate.config_yaml import build_section
from qmigrate.engine.engine import Engine
from qmigrate.hub.loading import fetch_hub_model, load_model, resolve_model
from qmigrate.hub.tokenizer_info import load_tokenizer_info
from qmigrate.ingest.json_checks import is_int_list
from qmigrate.ingest.prompts import PromptError, parse_request, seed_of, to_spec
from qmigrate.offline.loop import OfflineSeq, run_to_end
from qmigrate.offline.params import CompletionOutput, RequestOutput, SamplingParams, message_of
from qmigrate.wire.protocol import Finish
from qmigrate.worker.state import SeqState


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", trust_remote_code: bool = False,
                 load_format: str = "auto", seed: int | None = None, **settings):
        """`model`: a model directory, a hub name, `smollm2`, or None (the built-in tiny model).
        `settings`: worker settings (config.WorkerConfig); `device` defaults to the first GPU,
        else the CPU. `load_format` "dummy" makes the weights from config.json alone (random, in
        their real shapes). `seed` seeds the draws of requests that give none."""
        settings.setdefault("device", "cuda:0" if torch.cuda.is_available() else "cpu")
        worker = build_section(WorkerConfig, settings, "LLM settings")
        ModelConfig(path=model, dtype=dtype, trust_remote_code=trust_remote_code, load_format=load_format)
        if worker.tensor_parallel_size != 1:
            raise ValueError("LLM runs the model on one device: tensor_parallel_size must be 1")
        path = resolve_model(model)
        if not Path(path).is_dir():
            path = fetch_hub_model(path)
        loaded, _ = load_model(path, worker.device, dtype, trust_remote_code=trust_remote_code,
                               load_format=load_format)
        engine = Engine(loaded, worker.engine_config(), own_model=True)
        del loaded
        engine.warm_up()
        tokenizer, _, eos_ids = load_tokenizer_info(path, trust_remote_code)
        self._attach(engine, tokenizer, eos_ids, seed)

    @classmethod
    def from_engine(cls, engine, tokenizer=None, eos_ids=(), seed: int | None = None) -> "LLM":
        """Over an engine built elsewhere. Without a tokenizer, prompts and stops are token ids
        and outputs have no text."""
        llm = cls.__new__(cls)
        llm._attach(engine, tokenizer, eos_ids, seed)
        return llm

    def _attach(self, engine, tokenizer, eos_ids, seed) -> None:
        self.engine, self.tokenizer, self.eos_ids = engine, tokenizer, sorted(eos_ids)
        # the ids a prompt may name: every row of the embedding, whatever the tokenizer's size (a
        # padded vocabulary, or a shape with a smaller tokenizer, emits ids past it; serve's
        # ingest takes those too), and none past it, which the engine could not embed
        self.vocab_size = engine.shape.vocab_size
        self.rng = random.Random(seed)
        self._request_ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 on_step=None) -> list[RequestOutput]:
        """Run every prompt to its end; one RequestOutput per prompt, in order. `prompts`: a
        text, a list of token ids, or a list of those; `sampling_params`: one for all or one
        per prompt. Every prompt is checked before any runs (ValueError naming the prompt).
        `on_step(indices)`, if given, is called once with none when the checks are done and
        the first step is next, then after each step with the prompts that got a token in it."""
        items = _prompt_list(prompts)
        params = _params_list(sampling_params, len(items))
        checked = [self._check(i, item, sp) for i, (item, sp) in enumerate(zip(items, params))]
        seqs = []
        for prompt in checked:
            spec = to_spec(prompt, 1, seed_of(prompt, self.rng), self.eos_ids)
            seqs.append(OfflineSeq(prompt.prompt_ids, SeqState.from_spec(spec, spec.ids)))
        run_to_end(self.engine, seqs, on_step)
        return [self._output(item, seq, sp) for item, seq, sp in zip(items, seqs, params)]

    def _check(self, i: int, item, sp: SamplingParams):
        obj = ({"prompt": item} if isinstance(item, str) else {"prompt_ids": item}) | sp.request_fields()
        if self.tokenizer is None and (isinstance(item, str) or sp.stop_strings):
            raise ValueError(f"prompt {i}: without a tokenizer, prompts and stops are token ids")
        try:
            return parse_request(obj, str(i), tokenizer=self.tokenizer, max_context=self.engine.max_len,
                                 eos_ids=self.eos_ids, vocab_size=self.vocab_size)
        except PromptError as exc:
            raise ValueError(f"prompt {i}: {message_of(exc)}") from None

    def _output(self, item, seq: OfflineSeq, sp: SamplingParams) -> RequestOutput:
        text = ""
        if sp.detokenize and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.out, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if seq.finish is Finish.STOP:   # as the OpenAI API: the stop string is not part of the text
                end = next((s for s in sorted(sp.stop_strings, key=len, reverse=True) if text.endswith(s)), "")
                text = text[:len(text) - len(end)]
        return RequestOutput(str(next(self._request_ids)), item if isinstance(item, str) else None,
                             list(seq.prompt_ids), [CompletionOutput(0, text, list(seq.out), seq.finish.openai_reason)],
                             num_cached_tokens=seq.num_cached)


def _prompt_list(prompts) -> list:
    """One prompt (a text, or token ids) or a list of them, as a list."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and is_int_list(prompts)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and all(isinstance(p, (str, list)) for p in prompts):
        return list(prompts)
    raise ValueError("prompts must be a text, a list of token ids, or a list of those")


def _params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)) and len(sampling_params) == n \
            and all(isinstance(sp, SamplingParams) for sp in sampling_params):
        return list(sampling_params)
    raise ValueError(f"sampling_params must be a SamplingParams or a list of {n} of them (one per prompt)")
