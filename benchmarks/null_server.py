"""An OpenAI-compatible server that answers every completion at once with one token: what
`qmigrate bench serve` measures against it is the client's own cost (and the loopback's),
the floor under every TTFT it reports.

Run: `python -m benchmarks.null_server --port 18777`, then
`qmigrate bench serve --base-url http://127.0.0.1:18777 [--client-processes N] ...`.
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

MODEL = "null"


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def completions(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_event({"object": "text_completion", "model": MODEL,
                             "choices": [{"index": 0, "text": "a", "finish_reason": None}]})
                     + _event({"object": "text_completion", "model": MODEL,
                               "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                               "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}})
                     + b"data: [DONE]\n\n")
    return resp


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def make_app() -> web.Application:
    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18777)
    args = ap.parse_args()
    web.run_app(make_app(), host=args.host, port=args.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
