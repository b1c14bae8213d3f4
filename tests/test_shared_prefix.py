"""Decode attention that reads a shared prefix once per group: the grouping of a step's block
table, and the kernels against the torch reference (interpreted without CUDA)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (and of our kernels) in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from qmigrate.engine.kernels import paged_attention as pa  # noqa: E402
from qmigrate.engine.kernels import shared_prefix as sp  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
ON_CPU = pytest.param("cpu", marks=pytest.mark.skipif(
    not pa.is_interpreted(), reason="no CUDA, and triton was imported before TRITON_INTERPRET could be set"))
ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
BS = 16


def table_of(rows, width=None):
    width = width or max(len(r) for r in rows)
    t = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        t[i, :len(r)] = r
    return t


def test_rows_sharing_leading_blocks_form_a_group_capped_below_the_newest_key():
    # rows 0, 2 and 3 share blocks 1-5; row 3 holds only 4 full blocks before its newest key
    table = table_of([[1, 2, 3, 4, 5, 6, 7], [9, 10], [1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 5]])
    seq_lens = np.array([7 * BS, 2 * BS, 6 * BS - 3, 4 * BS + 1], dtype=np.int32)
    row_start, group_rows, group_len = sp.groups(table, seq_lens, BS, max_rows=8)
    assert group_len.tolist() == [4 * BS]
    assert sorted(r for r in group_rows[0].tolist() if r >= 0) == [0, 2, 3]
    assert row_start.tolist() == [4 * BS, 0, 4 * BS, 4 * BS]


def test_a_group_keeps_only_the_blocks_all_its_rows_share():
    table = table_of([[1, 2, 3, 4, 5, 11], [1, 2, 3, 4, 6, 12], [1, 2, 3, 7, 13, 14]])
    seq_lens = np.full(3, 6 * BS, dtype=np.int32)
    row_start, _, group_len = sp.groups(table, seq_lens, BS, max_rows=8, min_keys=BS)
    assert group_len.tolist() == [3 * BS] and row_start.tolist() == [3 * BS] * 3


def test_large_groups_are_cut_and_a_lone_row_shares_nothing():
    shared = [1, 2, 3, 4, 5]
    table = table_of([shared + [10 + i] for i in range(7)])
    seq_lens = np.full(7, 6 * BS, dtype=np.int32)
    row_start, group_rows, group_len = sp.groups(table, seq_lens, BS, max_rows=3)
    assert group_len.tolist() == [5 * BS, 5 * BS]                       # pieces of 3, 3 and a lone 1
    members = sorted(r for r in group_rows.ravel().tolist() if r >= 0)
    assert len(members) == 6 and (row_start > 0).sum() == 6
    assert all(row_start[r] == 5 * BS for r in members)


def test_nothing_to_group():
    seq_lens = np.full(3, 3 * BS, dtype=np.int32)
    assert sp.groups(table_of([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), seq_lens, BS, 8) is None
    # two rows sharing a block, but fewer keys than the minimum
    assert sp.groups(table_of([[1, 2, 3], [1, 5, 6]]), seq_lens[:2], BS, 8, min_keys=2 * BS) is None
    # padding rows (the null block) never group
    assert sp.groups(table_of([[0, 0], [0, 0]]), np.ones(2, dtype=np.int32), BS, 8, min_keys=1) is None
    assert sp.groups(table_of([[1, 2]]), seq_lens[:1], BS, 8) is None


def test_step_groups_are_reused_only_while_the_rows_and_their_leading_blocks_stay():
    calls = []
    real = sp.groups

    def counted(*args):
        calls.append(1)
        return real(*args)
    table = table_of([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [8, 9]])
    lens = np.array([6 * BS, 6 * BS, 2 * BS], dtype=np.int32)             # blocks 1-5 shared
    step = sp.StepGroups(BS, 8)
    sp.groups = counted
    try:
        first = step([1, 2, 3], table, lens)
        assert step([1, 2, 3], table, lens + 1) is first and len(calls) == 1      # the next decode step
        wider = np.pad(table, ((0, 0), (0, 1)))
        wider[0, 6] = 10
        assert step([1, 2, 3], wider, lens + BS) is first and len(calls) == 1    # a row opened a block
        moved = table.copy()
        moved[1, 4] = 11                                                          # a row's blocks changed
        assert step([1, 2, 3], moved, lens)[2].tolist() == [4 * BS] and len(calls) == 2
        assert step([1, 3, 2], moved, lens) is not None and len(calls) == 3       # other rows
        # a row now shorter than what it shared: found again (and too short to share now)
        assert step([1, 3, 2], moved, np.array([2 * BS, 6 * BS, 6 * BS], dtype=np.int32)) is None
        assert len(calls) == 4
    finally:
        sp.groups = real


def make_groups_cache(layout, num_kv_heads, group, head_dim, dtype, device, seed):
    """layout: per group (shared blocks, [private keys per row]). Blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(s + sum(-(-k // BS) for k in rows) for s, rows in layout)
    free = list(range(1, need + 1))
    rng.shuffle(free)
    tables, lens = [], []
    for shared_blocks, rows in layout:
        shared = [free.pop() for _ in range(shared_blocks)]
        for keys in rows:
            tables.append(shared + [free.pop() for _ in range(-(-keys // BS))])
            lens.append(shared_blocks * BS + keys)
    rng.shuffle(order := list(range(len(tables))))
    tables = [tables[i] for i in order]
    lens = [lens[i] for i in order]
    shape = (need + 1, BS, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    k[0] = v[0] = 0
    q = torch.randn(len(tables), group * num_kv_heads, head_dim, generator=gen)
    table = table_of(tables)
    seq_lens = np.array(lens, dtype=np.int32)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to),
            torch.from_numpy(seq_lens).to(**to), torch.from_numpy(table).to(**to), table, seq_lens)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_over_shared_prefixes_matches_the_reference(device, group):
    # three groups (one of a single row), rows with a key or several blocks of their own
    layout = [(6, [1, 17, 40]), (4, [5, 16, 33, 2, 9]), (5, [20]), (0, [70, 3])]
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        q, k, v, seq_lens, tables, host_table, host_lens = make_groups_cache(
            layout, 2, group, 64, dtype, device, seed=group)
        rows = sp.rows_per_group(q.shape[1], 2, 64)
        host = sp.groups(host_table, host_lens, BS, min(rows, 4))
        assert host is not None and len(host[2]) >= 2
        shared = sp.to_device(host, q.device)
        query_start = torch.arange(len(host_lens) + 1, dtype=torch.int32, device=q.device)
        expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.125)
        for softcap in (0.0, 2.0):
            if softcap:
                expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.125,
                                                        softcap=softcap)
            out = torch.full_like(q, float("nan"))
            pa.decode_attention(q, k, v, seq_lens, tables, 0.125, out=out, shared=shared, softcap=softcap)
            assert not out.isnan().any()
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_unused_group_slots_and_rows_outside_groups_are_plain_decode(device):
    """The fixed shapes a graph replays: more group slots than groups, rows -1 padded."""
    layout = [(5, [3, 30]), (0, [50]), (0, [9])]
    q, k, v, seq_lens, tables, host_table, host_lens = make_groups_cache(layout, 2, 4, 32, torch.float32,
                                                                         device, seed=5)
    row_start, group_rows, group_len = sp.groups(host_table, host_lens, BS, 8)
    slots = sp.max_groups(len(host_lens)) + 1
    padded_rows = np.full((slots, 8), -1, dtype=np.int32)
    padded_rows[:len(group_len)] = group_rows
    padded_len = np.zeros(slots, dtype=np.int32)
    padded_len[:len(group_len)] = group_len
    shared = sp.to_device((row_start, padded_rows, padded_len), q.device)
    query_start = torch.arange(len(host_lens) + 1, dtype=torch.int32, device=q.device)
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.2)
    out = pa.decode_attention(q, k, v, seq_lens, tables, 0.2, shared=shared)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
