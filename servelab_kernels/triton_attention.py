"""Triton twins of servelab_kernels.attention: KV store, paged decode attention, paged prefill attention.

Same arguments as the torch references, same head-major cache layout
([num_blocks, kv_heads, block_size, head_dim], an int8 cache with fp16 scales per token and
head). On the CPU they run only under TRITON_INTERPRET=1 (the tests); scores and the running
softmax are kept in fp32.

- store_kv: one program per (token, kv head); a negative slot is padding and is skipped.
- decode: one program per (sequence, kv head, split of the context); the GQA group's query heads
  share each K/V tile; online softmax; a second kernel merges the splits (split-K, so one long
  sequence still fills the GPU). The grid depends only on the batch and max_model_len, so a
  decode step can be captured in a CUDA graph.
- prefill: one launch for every chunk of the batch: programs per (sequence, head, tile of
  queries) walk the cached prefix and the chunk itself, causally.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_LEN = 512  # decode: context tokens per split


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    return tl.where(tie & ((r % 2) != 0), r - 1.0, r)


@triton.jit
def _store_kv_kernel(K, V, KC, VC, KS, VS, SLOT, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_co, stride_sb, stride_sh,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, INT8: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOT + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        d = tl.arange(0, D_PAD)
        dm = d < HEAD_DIM
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=dm, other=0.0)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=dm, other=0.0)
        dst = blk * stride_cb + h * stride_ch + off * stride_co + d
        if INT8:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            ks = tl.maximum(tl.max(tl.abs(k), 0) / 127.0, 1e-8)
            vs = tl.maximum(tl.max(tl.abs(v), 0) / 127.0, 1e-8)
            kq = tl.minimum(tl.maximum(_round_half_even(k / ks), -127.0), 127.0)
            vq = tl.minimum(tl.maximum(_round_half_even(v / vs), -127.0), 127.0)
            tl.store(KC + dst, kq.to(tl.int8), mask=dm)
            tl.store(VC + dst, vq.to(tl.int8), mask=dm)
            tl.store(KS + blk * stride_sb + h * stride_sh + off, ks.to(tl.float16))
            tl.store(VS + blk * stride_sb + h * stride_sh + off, vs.to(tl.float16))
        else:
            tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=dm)
            tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=dm)


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    num_tokens, kvh, d = k.shape
    if num_tokens == 0:
        return
    int8 = k_cache.dtype == torch.int8
    ks, vs = (k_scale, v_scale) if int8 else (k_cache, v_cache)  # placeholders when unused
    _store_kv_kernel[(num_tokens, kvh)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ks.stride(0) if int8 else 0,
        ks.stride(1) if int8 else 0, BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
        INT8=int8)


@triton.jit
def _load_kv_tile(C, S, blk, kvh, off, d, valid, dm, stride_cb, stride_ch, stride_co, stride_sb, stride_sh,
                  INT8: tl.constexpr):
    x = tl.load(C + (blk * stride_cb + kvh * stride_ch + off * stride_co)[:, None] + d[None, :],
                mask=valid[:, None] & dm[None, :], other=0.0).to(tl.float32)
    if INT8:
        s = tl.load(S + blk * stride_sb + kvh * stride_sh + off, mask=valid, other=0.0).to(tl.float32)
        x = x * s[:, None]
    return x


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of scores s [rows, keys] into the running max, sum and weighted values."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)


@triton.jit
def _decode_kernel(Q, KC, VC, KS, VS, BT, CTX, ACC, M, L, scale, stride_qb, stride_qh, stride_cb, stride_ch,
                   stride_co, stride_sb, stride_sh, stride_bt, stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, INT8: tl.constexpr,
                   PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(CTX + b)
    start = sp * SPLIT
    end = tl.minimum(start + SPLIT, ctx)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gm = g < GROUP
    dm = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(start, end, TILE):
        pos = t0 + tl.arange(0, TILE)
        valid = pos < end
        blk = tl.load(BT + b * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        k = _load_kv_tile(KC, KS, blk, kvh, off, d, valid, dm, stride_cb, stride_ch, stride_co, stride_sb, stride_sh,
                          INT8)
        v = _load_kv_tile(VC, VS, blk, kvh, off, d, valid, dm, stride_cb, stride_ch, stride_co, stride_sb, stride_sh,
                          INT8)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, PRECISION)
    tl.store(ACC + b * stride_ab + heads[:, None] * stride_ah + sp * stride_as + d[None, :], acc,
             mask=gm[:, None] & dm[None, :])
    tl.store(M + b * stride_mb + heads * stride_mh + sp, m_i, mask=gm)
    tl.store(L + b * stride_mb + heads * stride_mh + sp, l_i, mask=gm)


@triton.jit
def _merge_splits_kernel(ACC, M, L, OUT, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh,
                         NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    sm = s < NUM_SPLITS
    dm = d < HEAD_DIM
    m = tl.load(M + b * stride_mb + h * stride_mh + s, mask=sm, other=float("-inf"))
    l = tl.load(L + b * stride_mb + h * stride_mh + s, mask=sm, other=0.0)  # noqa: E741
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence (CUDA-graph padding): all weights 0
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    acc = tl.load(ACC + b * stride_ab + h * stride_ah + s[:, None] * stride_as + d[None, :],
                  mask=sm[:, None] & dm[None, :], other=0.0)
    num = tl.sum(w[:, None] * acc, 0)
    den = tl.sum(w * l, 0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=dm)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # bf16/fp16 values are exact in tf32


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None, v_scale=None,
                     packed=None, max_context_len: int | None = None, tile: int = 32) -> torch.Tensor:
    """`packed` is the reference's precomputed gather and is not needed here. The number of splits
    comes from `max_context_len` (the model's max_model_len for a CUDA graph), else the cache."""
    b, num_heads, d = q.shape
    kvh, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kvh
    max_ctx = max_context_len or block_tables.shape[1] * block_size
    splits = max(1, triton.cdiv(max_ctx, SPLIT_LEN))
    split = triton.cdiv(triton.cdiv(max_ctx, splits), tile) * tile
    acc = torch.empty(b, num_heads, splits, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b, num_heads, splits, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    out = torch.empty(b, num_heads, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    int8 = k_cache.dtype == torch.int8
    ks, vs = (k_scale, v_scale) if int8 else (k_cache, v_cache)
    _decode_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, acc, m, l_, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ks.stride(0) if int8 else 0,
        ks.stride(1) if int8 else 0, block_tables.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
        m.stride(0), m.stride(1), GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size, TILE=tile, SPLIT=split, INT8=int8,
        PRECISION=_precision(q.dtype))
    _merge_splits_kernel[(b, num_heads)](
        acc, m, l_, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1), out.stride(0),
        out.stride(1), NUM_SPLITS=splits, S_PAD=max(2, triton.next_power_of_2(splits)), HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d))
    return out


@triton.jit
def _prefill_kernel(Q, KC, VC, KS, VS, BT, CTX, QSL, OUT, scale, stride_qt, stride_qh, stride_cb, stride_ch,
                    stride_co, stride_sb, stride_sh, stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT8: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx = tl.load(CTX + seq)
        kvh = h // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = rows < q_len
        q_pos = ctx - q_len + rows
        d = tl.arange(0, D_PAD)
        dm = d < HEAD_DIM
        q = tl.load(Q + (q_start + rows)[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                    mask=rm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        hi = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)  # keys past the tile's last query are never seen
        for n0 in range(0, hi, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            kvalid = kpos < ctx
            blk = tl.load(BT + seq * stride_bt + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
            off = kpos % BLOCK_SIZE
            k = _load_kv_tile(KC, KS, blk, kvh, off, d, kvalid, dm, stride_cb, stride_ch, stride_co, stride_sb,
                              stride_sh, INT8)
            v = _load_kv_tile(VC, VS, blk, kvh, off, d, kvalid, dm, stride_cb, stride_ch, stride_co, stride_sb,
                              stride_sh, INT8)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where((kpos[None, :] <= q_pos[:, None]) & kvalid[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, PRECISION)
        out = acc / l_i[:, None]
        tl.store(OUT + (q_start + rows)[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale=None,
                      v_scale=None, host=None, block_m: int = 32, block_n: int = 32) -> torch.Tensor:
    """`host` = (query_start_loc, context_lens) as lists, as in the reference: here it only sizes the grid."""
    num_tokens, num_heads, d = q.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if host is not None:
        max_q = max(b - a for a, b in zip(host[0], host[0][1:]))
    else:
        max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    int8 = k_cache.dtype == torch.int8
    ks, vs = (k_scale, v_scale) if int8 else (k_cache, v_cache)
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_q, block_m))](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, query_start_loc, out, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ks.stride(0) if int8 else 0,
        ks.stride(1) if int8 else 0, block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=k_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, INT8=int8, PRECISION=_precision(q.dtype))
    return out
