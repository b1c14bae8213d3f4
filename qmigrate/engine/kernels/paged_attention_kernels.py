"""Triton kernels behind paged_attention; imported only where triton is.

The cache may hold e4m3 (kv_cache_dtype fp8): each tile of keys and values is upcast to the
queries' dtype as it is loaded (its scale is 1.0, engine/fp8.py).

Scores are kept in log2 units (the softmax scale is pre-multiplied by log2(e)) so the
online softmax uses exp2. Tiles of keys are gathered row by row through the block table,
so a tile of BLOCK_N keys may span several cache blocks in any order.
"""

import triton
import triton.language as tl


@triton.jit
def _attend(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, n0, key_end, qpos, offs_d,
            qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            BOUNDED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
            key_lo, cap_log2, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step over keys n0..n0+BLOCK_N. q [M, D], acc [M, D], m_i/l_i [M].

    k_ptr/v_ptr already point at this KV head; table_ptr at this row's block table.
    BOUNDED masks keys at or past key_end; CAUSAL masks keys after each query's qpos [M];
    WINDOWED masks keys before each query's key_lo [M] (a tile may then hold rows with no
    key yet). SOFTCAP: scores are cap_log2 * tanh(q.k * qk_scale), qk_scale = scale / cap.
    """
    pos = n0 + tl.arange(0, BLOCK_N)
    if BOUNDED:
        in_range = pos < key_end
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + pos // BLOCK_SIZE).to(tl.int64)
    slot = pos % BLOCK_SIZE
    k_off = block * stride_kb + slot * stride_ks
    v_off = block * stride_vb + slot * stride_vs
    if BOUNDED:
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])
    # an e4m3 cache (a scale of 1.0) is upcast to the queries' dtype; otherwise a no-op
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [M, BLOCK_N]
    if SOFTCAP:
        s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))                # tanh without libdevice
    if BOUNDED:
        s = tl.where(in_range[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(pos[None, :] <= qpos[:, None], s, float("-inf"))
    if WINDOWED:
        s = tl.where(pos[None, :] >= key_lo[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if WINDOWED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
    else:
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, table, kv_head, start, end, offs_d, qk_scale,
                 stride_kh, stride_kb, stride_ks, stride_vh, stride_vb, stride_vs, cap_log2,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """Keys start..end of one block table, no causal mask (every query sees them all), from
    the online-softmax state given; returns the new state and (output, log2-sum-exp), the
    output zeros and the weight -inf where there were no keys (never NaN)."""
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, n0, end, m_i, offs_d,
                                qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
                                BLOCK_SIZE, BLOCK_N, True, False, DOT_PRECISION, m_i, cap_log2, False, SOFTCAP)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, seq_lens_ptr, tables_ptr, out_ptr, lse_ptr,
                   qk_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_table,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh, window, cap_log2,
                   row_start_ptr, prefix_ptr, prefix_lse_ptr, stride_pt, stride_ph, stride_ps,
                   stride_pqt, stride_pqh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, WINDOWED: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                   SHARED: tl.constexpr = False, PREFIX_SPLITS: tl.constexpr = 1):
    """Program (row, KV head, split): the GROUP query heads of that KV head over one split.

    One split writes the normalised output; several write fp32 partials [B, Hq, S, D] and
    their log2-sum-exp [B, Hq, S] for merge_splits_kernel.

    SHARED (one split, no window): a row's first row_start[row] keys were attended by
    shared_prefix_kernel, whose PREFIX_SPLITS partials [B, Hq, P, D] and log2-sum-exps
    [B, Hq, P] start the online softmax; the row reads only its keys after them.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    # split length from the row's own length, so short rows are not spread thin; with a
    # window the keys before it are never read
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    elif SHARED:
        lo = tl.load(row_start_ptr + row)
    else:
        lo = 0
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0)                    # [GROUP_PAD, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if SHARED:
        # fold in the shared prefix's partials (none for a row outside every group)
        g_ok = (offs_g < GROUP) & (offs_g * 0 + lo > 0)
        for p in tl.static_range(PREFIX_SPLITS):
            lse_p = tl.load(prefix_lse_ptr + row * stride_pqt + heads * stride_pqh + p, mask=g_ok,
                            other=float("-inf"))
            o_p = tl.load(prefix_ptr + row * stride_pt + heads[:, None] * stride_ph + p * stride_ps
                          + offs_d[None, :], mask=g_ok[:, None], other=0.0)
            m_new = tl.maximum(m_i, lse_p)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            w = tl.exp2(lse_p - m_ref)
            l_i = l_i * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * o_p
            m_i = m_new
    table = tables_ptr + row.to(tl.int64) * stride_table
    # no keys (a padding row, or an empty split): zeros and a -inf weight
    o, lse = _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, table, kv_head, start, end, offs_d, qk_scale,
                          stride_kh, stride_kb, stride_ks, stride_vh, stride_vb, stride_vs, cap_log2,
                          BLOCK_SIZE, BLOCK_N, DOT_PRECISION, SOFTCAP)
    dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    g_mask = (offs_g < GROUP)[:, None]
    if NUM_SPLITS == 1:
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=g_mask)
    else:
        tl.store(dst, o, mask=g_mask)
        tl.store(lse_ptr + row * stride_lt + heads * stride_lh + split, lse, mask=offs_g < GROUP)


@triton.jit
def merge_splits_kernel(part_ptr, lse_ptr, out_ptr, stride_pt, stride_ph, stride_ps,
                         stride_lt, stride_lh, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (row, query head): weight each split's output by its share of the softmax."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * stride_lt + head * stride_lh + offs_s,
                  mask=offs_s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)                                                    # [SPLITS_PAD]
    part = tl.load(part_ptr + row * stride_pt + head * stride_ph
                   + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=(offs_s < NUM_SPLITS)[:, None], other=0.0)           # [SPLITS_PAD, D]
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, query_start_ptr, seq_lens_ptr, tables_ptr,
                    tile_rows_ptr, tile_first_ptr, out_ptr,
                    qk_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_table, stride_ot, stride_oh, window, cap_log2,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, WINDOWED: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    """Program (tile, KV head): BLOCK_Q queries of one row x the GROUP heads of a KV head.

    Tile row m holds query m // GROUP, head m % GROUP. Keys every query of the tile sees run
    without masks; the rest, up to the tile's last query, run with the causal mask; keys
    past that are never read.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(tile_rows_ptr + tile)
    if row < 0:
        return
    first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(query_start_ptr + row)
    num_q = tl.load(query_start_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    context = seq_len - num_q                                 # cached keys before the queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    token = offs_m // GROUP
    valid = (token < BLOCK_Q) & (first + token < num_q)
    # rows past the tile clamp to a real query, so every row sees key 0 and stays finite
    query = tl.minimum(first + token, num_q - 1)
    qpos = context + query
    heads = kv_head * GROUP + offs_m % GROUP
    q_rows = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None], other=0.0)                               # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = tables_ptr + row.to(tl.int64) * stride_table
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    open_end = (context + first + 1) // BLOCK_N * BLOCK_N     # keys seen by every query
    key_end = context + tl.minimum(first + BLOCK_Q, num_q)     # one past the last query's key
    if WINDOWED:
        # from the first key the tile's first query sees, every tile masked
        key_lo = qpos - window + 1
        for n0 in range(tl.maximum(context + first - window + 1, 0), key_end, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, n0, key_end, qpos, offs_d,
                                    qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
                                    BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION,
                                    key_lo, cap_log2, True, SOFTCAP)
    else:
        for n0 in range(0, open_end, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, n0, key_end, qpos, offs_d,
                                    qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
                                    BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION,
                                    qpos, cap_log2, False, SOFTCAP)
        for n0 in range(open_end, key_end, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, n0, key_end, qpos, offs_d,
                                    qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
                                    BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION,
                                    qpos, cap_log2, False, SOFTCAP)
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def shared_prefix_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, group_rows_ptr, group_len_ptr, out_ptr, lse_ptr,
                          qk_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_table, stride_gr,
                          stride_ot, stride_oh, stride_os, stride_lt, stride_lh, cap_log2,
                          GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = False):
    """Program (group, KV head, split): the one query of each of a group's rows (up to ROWS,
    -1 padded) x the GROUP heads of a KV head, over one split of the group_len keys that its
    rows share block for block. Each key tile is read once for the whole group.

    Tile row m holds row m // GROUP, head m % GROUP. Writes fp32 partials [B, Hq, S, D] and
    log2-sum-exps [B, Hq, S] (-inf for an empty split) for decode_kernel's SHARED mode.
    """
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(group_len_ptr + group)
    if length == 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    member = offs_m // GROUP
    row = tl.load(group_rows_ptr + group * stride_gr + member, mask=member < ROWS, other=-1)
    valid = row >= 0
    row = tl.where(valid, row, 0).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP
    q = tl.load(q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None], other=0.0)                               # [BLOCK_M, D]
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = tl.load(group_rows_ptr + group * stride_gr).to(tl.int64)      # every row's table starts alike
    o, lse = _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, tables_ptr + first * stride_table, kv_head, start, end,
                          offs_d, qk_scale, stride_kh, stride_kb, stride_ks, stride_vh, stride_vb, stride_vs,
                          cap_log2, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, SOFTCAP)
    tl.store(out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
             o, mask=valid[:, None])
    tl.store(lse_ptr + row * stride_lt + heads * stride_lh + split, lse, mask=valid)
