"""The detokenizer role: loop.py around the pure incremental decoder and output sinks (decoder.py)."""
