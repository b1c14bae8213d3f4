"""The engine's settings: one step's limits, the KV pool's size, and the runner's choices."""

from __future__ import annotations

from dataclasses import dataclass

RUNNERS = ("auto", "fast", "hf")

DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass(slots=True)
class EngineConfig:
    runner: str = "auto"                  # auto | fast | hf
    block_size: int = 16
    max_kv_tokens: int = 0                # 0: size the pool from memory
    gpu_memory_utilization: float = 0.9   # share of the GPU's memory this process may fill
    cpu_kv_bytes: int = DEFAULT_CPU_KV_BYTES
    max_len: int = 0                      # 0: the model's context
    max_batch: int = 256                  # rows of a step (CUDA graphs are captured up to it)
    max_batch_tokens: int = 8192          # new tokens of a step
    max_padding: float = 0.25             # HF runner: padding allowed when grouping prefills
    prefill_chunk: int = 512              # longer prompts fill their KV in chunks (0: never)
    # prompt tokens a step carries; the rest of a prompt waits for later steps (0: no limit)
    prefill_tokens_per_step: int = 0
    # the same while the step has decode rows (0: no limit; the worker's default is set in config.py)
    prefill_tokens_with_decode: int = 0
    prefill_spread_steps: int = 0         # that limit grows to 1/N of the prompt tokens waiting (0: fixed)
    cuda_graphs: bool = True
    prefix_cache: bool = True             # full blocks of known ids are kept and shared by prefix
    shared_prefix_attention: bool = True  # fast runner: a prefix rows share is read once per group

    def __post_init__(self):
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
