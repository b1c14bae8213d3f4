"""The engine in this process: `LLM` (llm.py) over the offline loop (loop.py), with
`SamplingParams` and `RequestOutput` (params.py)."""
