"""The messages a worker sends for a lease, built from its bookkeeping: the StepResult to
the router, and the Tokens (with any logprobs) for the detokenizer."""

from __future__ import annotations

import dataclasses

from qmigrate.engine.engine import Engine
from qmigrate.wire import protocol as P
from qmigrate.worker.state import Started


def step_result(run: Started, engine: Engine) -> P.StepResult:
    """The StepResult of a lease run to its end."""
    sids = run.seq_ids
    return P.StepResult(run.lease.lease_id, P.pack_i64(sids), P.pack_i32([len(run.out[s]) for s in sids]),
                        P.pack_i32([t for s in sids for t in run.out[s]]),
                        P.pack_u8([int(run.status[s]) for s in sids]), engine.free_tokens,
                        P.pack_i64(engine.take_evicted() + run.lost),
                        P.pack_i64(engine.take_prefix_events()),
                        P.pack_i32([run.cached.get(s, -1) for s in sids]),
                        *_tier_report(engine))


def _tier_report(engine: Engine) -> tuple[bytes, bytes]:
    """StepResult's tier_events and tier_stats (empty without a host tier)."""
    stats = engine.tier_stats()
    if not stats:
        return b"", b""
    return P.pack_i64(engine.take_tier_events()), P.pack_i64([stats[k] for k in P.TIER_STATS])


def unrun_result(lease: P.Lease, free_tokens: int) -> P.StepResult:
    """The answer to a lease withdrawn before it started: every row, no token, still running."""
    n = len(P.unpack_i64(lease.seq_ids, "seq_ids"))
    return P.StepResult(lease.lease_id, lease.seq_ids, P.pack_i32([0] * n), b"", P.pack_u8([0] * n),
                        free_tokens)


def tokens_of(run: Started, final: bool) -> P.Tokens:
    """For the detokenizer: tokens not sent yet (after any it may have missed), and the
    end of rows that ended; in the `final` one a row's code is its status at the end."""
    shown, sent_of, out, ended, announced = [], run.shown, run.out, run.ended, run.announced
    for sid in run.seq_ids:
        tokens = out[sid]
        sent = sent_of.get(sid, 0)
        ends = sid in ended and sid not in announced
        resend = run.resend.pop(sid, []) if run.resend else []
        if not (len(tokens) > sent or resend or ends or final):
            continue
        code = run.status[sid]
        new = tokens[sent:]
        if not (new or resend or ends):
            continue
        start = run.first_index.get(sid, 0) + sent - len(resend)
        shown.append((sid, start, resend + new, int(code) if (final or ends) else 0, sent, len(resend)))
        sent_of[sid] = sent + len(new)
        if ends:
            announced.add(sid)
    msg = P.Tokens(P.pack_i64([x[0] for x in shown]), P.pack_i32([x[1] for x in shown]),
                   P.pack_i32([len(x[2]) for x in shown]), P.pack_i32([t for x in shown for t in x[2]]),
                   P.pack_u8([x[3] for x in shown]),
                   P.pack_i32([run.cached.get(x[0], -1) for x in shown]) if run.cached else b"")
    return _with_logprobs(run, msg, shown) if run.lps or run.prompt_lps else msg


def _with_logprobs(run: Started, msg: P.Tokens, shown: list[tuple]) -> P.Tokens:
    """The Tokens with the logprobs of its rows that asked (a resent token has none), and
    a prompt's with the row of its first token."""
    entries, counts, prompts = [], [], []
    for sid, start, tokens, _, sent, num_resent in shown:
        made = run.lps.get(sid)
        entries += [None] * num_resent
        entries += (made[sent:sent + len(tokens) - num_resent] if made is not None
                    else [None] * (len(tokens) - num_resent))
        prompt = run.prompt_lps.pop(sid, None) if start == 0 and tokens else None
        counts.append(0 if prompt is None else len(prompt[0]))
        if prompt is not None:
            prompts += [(prompt[0], prompt[1], k) for k in range(len(prompt[0]))]
    fields = {}
    if any(e is not None for e in entries):
        width, values, ids = P.pack_logprob_refs(entries, 1)
        fields.update(lp_width=width, lp_values=values, lp_top_ids=ids)
    if prompts:
        width, values, ids = P.pack_logprob_refs(prompts, 2)
        fields.update(prompt_counts=P.pack_i32(counts), prompt_width=width, prompt_values=values,
                      prompt_top_ids=ids)
    return dataclasses.replace(msg, **fields) if fields else msg
