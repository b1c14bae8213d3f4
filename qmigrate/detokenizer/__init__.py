"""The detokenizer role: loop.py around the pure incremental decoder (decoder.py) and output sinks (sinks.py, their formats in formats.py)."""

# The detokenizer's exit status once its input is done (sim) when a request it printed failed
# (refused by ingest, or ended by a worker's error); the node then exits with it.
EXIT_REQUESTS_FAILED = 3
