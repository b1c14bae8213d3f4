"""The ingest role: loop.py reads prompts from stdin, feeders and the HTTP API (http.py, openai_api.py, openai_replies.py) and validates them (prompts.py)."""
