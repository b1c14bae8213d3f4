"""Sending a load's calls at their arrival times: what `bench serve` does in this process
(serve.py) and in each client process (serve_procs.py)."""

from __future__ import annotations

import asyncio
import time

from qmigrate.bench.serve_client import Client
from qmigrate.bench.serve_data import ServeRequest
from qmigrate.bench.serve_stats import CallRecord


async def send_all(client: Client, requests: list[ServeRequest], bodies: list[bytes | None], offsets: list[float],
                   t0: float, max_concurrency: int | None, records: list[CallRecord], on_call) -> None:
    """Sends requests[i] at t0 + offsets[i] (its body already encoded, unless it is a session),
    appending a record per call and calling on_call() after each."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: ServeRequest, body: bytes | None, offset: float):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()
        try:
            if not req.is_session:
                rec = CallRecord(0.0, expected_tokens=req.output_len, prompt_tokens=req.prompt_len,
                                 structured=req.response_format is not None)
                records.append(rec)
                await client.post_completion(body, rec)
                on_call(rec)
                return
            if client.sessions_as == "ids":
                await _id_session(client, req, records, on_call)
                return
            answers = []
            for i in range(len(req.turns)):  # each turn carries the earlier turns and their answers
                if i and req.think_time_s:
                    await asyncio.sleep(req.think_time_s)
                n = req.turn_output_len(i)
                rec = CallRecord(0.0, expected_tokens=n, turn=i)
                records.append(rec)
                earlier = req.answers[:i] if req.answers else answers   # the dataset's, when it has them
                answers.append(await client.session_call(req.turns[:i + 1], earlier, n, rec))
                on_call(rec)
                if not rec.ok:
                    return
        finally:
            if gate is not None:
                gate.release()

    await asyncio.gather(*(one(req, body, off) for req, body, off in zip(requests, bodies, offsets)))


async def _id_session(client: Client, req: ServeRequest, records: list[CallRecord], on_call) -> None:
    """A session as token ids: each turn's prompt is the one before, the ids of the answer to it
    (the server's, or the dataset's where the session has them) and the next turn's ids."""
    prompt: list[int] = []
    answer: list[int] = []
    for i, piece in enumerate(req.turn_ids):
        if i and req.think_time_s:
            await asyncio.sleep(req.think_time_s)
        earlier = len(prompt) + len(answer)
        prompt = prompt + answer + piece
        n = req.turn_output_len(i)
        rec = CallRecord(0.0, expected_tokens=n, turn=i, prompt_tokens=len(prompt), earlier_tokens=earlier)
        records.append(rec)
        answer = await client.complete_ids(prompt, n, rec)
        if req.answer_ids:
            answer = req.answer_ids[i]
        on_call(rec)
        if not rec.ok:
            return
