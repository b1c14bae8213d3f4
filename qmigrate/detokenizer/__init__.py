"""The detokenizer role: loop.py around the pure incremental decoder (decoder.py) and output sinks (sinks.py)."""
