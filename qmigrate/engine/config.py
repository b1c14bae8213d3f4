"""The engine's settings, each defined once with its default and its check: one step's limits,
the KV pool's size, and the runner's choices. A worker's section of the topology is these
fields and the worker's own (config.WorkerConfig extends this class), so the engine runs with
exactly what the topology says. Names are vLLM's where vLLM has the setting."""

from __future__ import annotations

from dataclasses import dataclass

from qmigrate import config_rules as rules
from qmigrate.config_rules import Section

RUNNERS = ("auto", "fast", "hf")
QUANTIZATIONS = ("none", "fp8")            # engine/fp8.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

DEFAULT_CPU_KVCACHE_SPACE_BYTES = 2 << 30


@dataclass(slots=True)
class EngineConfig(Section):
    runner: str = rules.setting("auto", rules.one_of(*RUNNERS))
    # rows of a step (CUDA graphs are captured up to it)
    max_num_seqs: int = rules.setting(64, rules.count)
    # new tokens of a step; a step of prompts alone takes up to this many
    max_num_batched_tokens: int = rules.setting(8192, rules.count)
    max_model_len: int = rules.setting(0, rules.non_negative)     # 0: the model's context
    block_size: int = rules.setting(16, rules.rule("a power of two from 1 to 256",
                                                   lambda v: rules.is_int(v) and 1 <= v <= 256 and v & (v - 1) == 0))
    max_kv_tokens: int = rules.setting(0, rules.non_negative)     # 0: size the KV pool from memory
    # share of the GPU's memory this process may fill, weights and KV pool together
    gpu_memory_utilization: float = rules.setting(0.9, rules.number("a number in (0, 1]", lambda x: 0 < x <= 1))
    # the KV pool of a worker on the CPU
    cpu_kvcache_space_bytes: int = rules.setting(DEFAULT_CPU_KVCACHE_SPACE_BYTES, rules.count)
    enforce_eager: bool = rules.setting(False, rules.boolean)     # true: no CUDA graphs
    # full blocks of known ids are kept and shared by prefix
    enable_prefix_caching: bool = rules.setting(True, rules.boolean)
    # GiB of host memory for the KV tier (vLLM's kv_offloading_size): cached blocks the pool
    # evicts are kept there and copied back on a hit instead of prefilled (engine/kv/host_tier.py).
    # -1 (the default): sized from host memory on a GPU (min(available RAM / 4 / GPUs here,
    # 64 GiB)) and page-locked while the worker idles, off on the CPU, whose pool is host
    # memory already; 0: off; a positive size applies on the CPU too.
    kv_offloading_size: float = rules.setting(-1.0, rules.number("a number of GiB >= 0, or -1 (sized from host memory)",
                                                                lambda x: x >= 0 or x == -1))
    # decode steps read a prefix that rows share (the same cached blocks) once per group of
    # rows, not once per row (fast runner; engine/kernels/shared_prefix.py)
    shared_prefix_attention: bool = rules.setting(True, rules.boolean)
    prefill_chunk: int = rules.setting(512, rules.non_negative)   # longer prompts fill their KV in chunks (0: never)
    # prompt tokens one step carries: a longer prompt (or several) is spread over the following
    # steps, each with the decode rows, so no step stalls them for a whole prompt (0: no limit)
    prefill_tokens_per_step: int = rules.setting(0, rules.non_negative)
    # prompt tokens a step carries while it also runs decode rows, whose streams all wait for
    # it; a step of prompts alone takes up to max_num_batched_tokens (0: no limit; docs/design.md)
    prefill_tokens_with_decode: int = rules.setting(0, rules.non_negative)
    # ... or 1/N of the prompt tokens waiting in the step, if more: a backlog is spread over
    # at most N steps (0: the limit is fixed)
    prefill_spread_steps: int = rules.setting(4, rules.non_negative)
    # fp8: the layers' projections in e4m3 with per-channel scales, activations quantized per
    # token, matmuls on the FP8 tensor cores (compute capability 9.0; the fast runner)
    quantization: str = rules.setting("none", rules.one_of(*QUANTIZATIONS))
    # fp8 (fp8_e4m3): the KV pool stores e4m3 with a scale of 1.0, twice the tokens of bf16
    # (compute capability 8.9; the fast runner); auto: the model's dtype
    kv_cache_dtype: str = rules.setting("auto", rules.one_of(*KV_CACHE_DTYPES))
    # HF runner: padding allowed when grouping prefills, as a share of their real tokens
    max_padding: float = rules.setting(0.25, rules.number("a number >= 0", lambda x: x >= 0))
