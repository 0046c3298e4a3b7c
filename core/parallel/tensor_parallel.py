"""Tensor parallelism for the Llama family (Megatron's layout), as module swaps on a loaded model.

Every rank loads the same full model, keeps its slice, quantizes the slice, then wraps the layers
that must talk:

- attention: each rank holds whole KV-head groups (a KV head and the query heads that read it),
  split as evenly as the groups allow, so GQA stays uniform on every rank and the KV cache shards
  with the heads; with fewer KV heads than ranks, each rank holds a share of one group's query
  heads and a replica of its KV head. q/k/v are column-parallel, o_proj row-parallel;
- MLP: gate/up column-parallel over the intermediate size, down_proj row-parallel;
- embedding and LM head vocabulary-parallel: each rank looks up (or scores) its rows of the
  vocabulary, an all-reduce (an all-gather) completes them.

Row-parallel layers sum partial products across ranks with one all-reduce (in fp32, so the sum
rounds once, as a single matmul's would), their bias on rank 0 only. A row-parallel slice that is
quantized to INT8 keeps its full row's scale (`row_absmax`), and INT4 groups never straddle two
ranks, so the quantized shards are exactly the full quantized matrices, split with their scales.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.errors import ConfigError


@dataclass
class CommStats:
    """Time rank 0 spent in collectives (the all-reduce share of a step)."""

    seconds: float = 0.0
    calls: int = 0


STATS = CommStats()


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    STATS.seconds += time.perf_counter() - t0
    STATS.calls += 1
    return out


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    acc = x.float()
    _timed(dist.all_reduce, acc)
    return acc.to(x.dtype)


@dataclass(frozen=True)
class Shard:
    """What one rank holds: query heads [q0, q0 + nq), KV heads [kv0, kv0 + nkv), intermediate
    [i0, i0 + ni), vocabulary [v0, v0 + nv) (rows padded to `v_per_rank` for the gather)."""

    rank: int
    world: int
    q0: int
    nq: int
    kv0: int
    nkv: int
    i0: int
    ni: int
    v0: int
    nv: int
    v_per_rank: int


def _even(n: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def plan_shard(args, rank: int, world: int) -> Shard:
    """The slice of each dimension rank `rank` of `world` holds; a ConfigError when the heads do not split."""
    heads, kv = args.num_heads, args.num_kv_heads
    group = heads // kv
    if kv >= world:
        g0, ng = _even(kv, world, rank)
        q0, nq, kv0, nkv = g0 * group, ng * group, g0, ng
    else:
        if world % kv or group % (world // kv):
            raise ConfigError(f"{heads} query heads in {kv} KV groups do not split over {world} ranks "
                              "(each rank needs whole groups, or an equal share of one)")
        per = group // (world // kv)
        q0, nq = rank * per, per
        kv0, nkv = q0 // group, 1
    i0, ni = _even(args.intermediate_size, world, rank)
    v_per_rank = -(-args.vocab_size // world)
    v0 = rank * v_per_rank
    return Shard(rank, world, q0, nq, kv0, nkv, i0, ni, v0, max(0, min(v_per_rank, args.vocab_size - v0)), v_per_rank)


def _linear(lin: nn.Linear, rows: slice | None = None, cols: slice | None = None, bias: bool = True) -> nn.Linear:
    w = lin.weight.data
    out = type(lin)(1, 1, bias=False, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w[rows or slice(None), cols or slice(None)].contiguous(), requires_grad=False)
    out.in_features, out.out_features = out.weight.shape[1], out.weight.shape[0]
    if lin.bias is not None and bias:
        out.bias = nn.Parameter(lin.bias.data[rows or slice(None)].contiguous(), requires_grad=False)
    if cols is not None:  # an INT8 row-parallel slice quantizes with its whole row's scale
        out.row_absmax = w.float().abs().amax(dim=1)
    return out


def slice_model(model: nn.Module, s: Shard) -> None:
    """Keep this rank's slice of every weight (before quantization); see the module docstring."""
    hd = model.args.head_dim
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        q, kv = slice(s.q0 * hd, (s.q0 + s.nq) * hd), slice(s.kv0 * hd, (s.kv0 + s.nkv) * hd)
        a.q_proj, a.k_proj, a.v_proj = _linear(a.q_proj, q), _linear(a.k_proj, kv), _linear(a.v_proj, kv)
        a.o_proj = _linear(a.o_proj, cols=q, bias=s.rank == 0)
        a.num_heads, a.num_kv_heads = s.nq, s.nkv
        i = slice(s.i0, s.i0 + s.ni)
        m.gate_proj, m.up_proj = _linear(m.gate_proj, i), _linear(m.up_proj, i)
        m.down_proj = _linear(m.down_proj, cols=i, bias=s.rank == 0)
    v = slice(s.v0, s.v0 + s.nv)
    emb = model.model.embed_tokens
    tied = model.lm_head.weight is emb.weight
    model.lm_head = _linear(model.lm_head, v)
    model.model.embed_tokens = nn.Embedding(s.nv, emb.embedding_dim, device=emb.weight.device, dtype=emb.weight.dtype)
    model.model.embed_tokens.weight = model.lm_head.weight if tied else nn.Parameter(emb.weight.data[v].contiguous(),
                                                                                        requires_grad=False)


class RowParallel(nn.Module):
    """A row-parallel layer: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary (any embedding module: plain or quantized); zero for
    ids another rank holds, so the all-reduce completes every row exactly."""

    def __init__(self, inner: nn.Module, v0: int, nv: int) -> None:
        super().__init__()
        self.inner, self.v0, self.nv = inner, v0, nv

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.v0
        mine = (local >= 0) & (local < self.nv)
        rows = self.inner(local.clamp(0, max(self.nv - 1, 0)))
        return all_reduce(rows * mine[:, None].to(rows.dtype))


class VocabParallelHead(nn.Module):
    """This rank's logits columns, gathered from every rank into the whole vocabulary."""

    def __init__(self, inner: nn.Module, s: Shard, vocab_size: int) -> None:
        super().__init__()
        self.inner, self.pad, self.vocab_size = inner, s.v_per_rank - s.nv, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden)
        if self.pad:
            local = torch.nn.functional.pad(local, (0, self.pad))
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        _timed(dist.all_gather, parts, local.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def connect_model(model: nn.Module, s: Shard) -> None:
    """After quantization: wrap the layers that must talk (whatever module each now is)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, s.v0, s.nv)
    model.lm_head = VocabParallelHead(model.lm_head, s, model.args.vocab_size)
