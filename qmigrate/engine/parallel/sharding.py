"""Tensor parallelism: one model split across the N ranks of a worker.

A `TensorParallel` is a rank's view of its group: its rank, the world size, the group
that carries activations (NCCL on GPUs, gloo on the CPU) and a gloo group for host data
(the step's arrays, KV shards, sizes agreed at startup, the followers' weight shards).

The layout (Megatron's, as in vLLM and nano-vllm):
- column-parallel linears split their output dim: q/k/v and gate/up (fused matrices are
  split part by part, so each rank's slice is again [q | k | v] or [gate | up]);
- row-parallel linears (o_proj, down_proj) split their input dim; an all-reduce sums the
  partial outputs (the bias is added by rank 0 only);
- the embedding is split by vocabulary: each rank looks up the ids it holds, zero for the
  others, and an all-reduce sums; the LM head is split by vocabulary too and the logits are
  all-gathered;
- attention heads are split evenly; KV heads too when there are at least as many as ranks,
  otherwise each KV head is replicated on world / num_kv_heads ranks;
- a mixture-of-experts layer keeps every expert on every rank and splits each expert's
  intermediate dim (gate/up by rows, down by columns), as its shared expert's: routing is
  the same on all ranks, and the routed and shared partial outputs are summed by one
  all-reduce, as a dense MLP's.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qmigrate.engine.layers.linear import Linear

COLLECTIVE_TIMEOUT_S = 120.0  # a rank that stops answering fails its peers' next collective
# Followers wait on the host group for rank 0's next command however long the worker idles;
# a rank that dies closes its connections, which fails the others' waits at once.
HOST_TIMEOUT_S = 30 * 24 * 3600.0


class LayoutError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class HeadLayout:
    world: int
    num_heads: int
    num_kv_heads: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world)

    def heads(self, rank: int) -> range:
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> range:
        if self.num_kv_heads >= self.world:
            n = self.kv_heads_per_rank
            return range(rank * n, (rank + 1) * n)
        first = rank * self.num_kv_heads // self.world   # replicated: world / num_kv_heads ranks each
        return range(first, first + 1)

    def kv_owner(self, head: int) -> int:
        """The first rank that holds KV head `head` (the one whose copy is exported)."""
        if self.num_kv_heads >= self.world:
            return head // self.kv_heads_per_rank
        return head * self.world // self.num_kv_heads


def check_layout(world: int, num_heads: int, num_kv_heads: int, intermediate_size: int | tuple[int, ...]) -> HeadLayout:
    """The head layout for `world` ranks, or a LayoutError that says what does not divide.
    `intermediate_size`: the MLP width, or every width the model's MLPs have (ModelShape.mlp_widths)."""
    if world < 1:
        raise LayoutError(f"tensor_parallel_size must be >= 1, got {world}")
    problems = []
    if num_heads % world:
        problems.append(f"{num_heads} attention heads")
    if num_kv_heads >= world and num_kv_heads % world:
        problems.append(f"{num_kv_heads} KV heads")
    if num_kv_heads < world and world % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads (fewer than the ranks, so they must divide {world})")
    widths = (intermediate_size,) if isinstance(intermediate_size, int) else intermediate_size
    problems += [f"an MLP width of {w}" for w in widths if w % world]
    if problems:
        raise LayoutError(f"tensor_parallel_size {world} does not divide the model's {', '.join(problems)}")
    return HeadLayout(world, num_heads, num_kv_heads)


# --- weight shards ------------------------------------------------------------------------
def split_rows(w: torch.Tensor | None, rank: int, world: int) -> torch.Tensor | None:
    """Column-parallel: rank's slice of the output dim (dim 0 of a weight, of a bias)."""
    if w is None:
        return None
    n = w.shape[0] // world
    return w[rank * n:(rank + 1) * n]


def split_cols(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Row-parallel: rank's slice of the input dim."""
    n = w.shape[1] // world
    return w[:, rank * n:(rank + 1) * n]


def split_parts(w: torch.Tensor | None, parts: list[int], ranges: list[range]) -> torch.Tensor | None:
    """A fused column-parallel weight [sum(parts), ...] (q|k|v, gate|up): rows `ranges[i]` of
    part i, concatenated in part order."""
    if w is None:
        return None
    pieces, at = [], 0
    for size, rows in zip(parts, ranges):
        pieces.append(w[at + rows.start:at + rows.stop])
        at += size
    return torch.cat(pieces)


def even_ranges(parts: list[int], rank: int, world: int) -> list[range]:
    """Each part split evenly: rank's row range within each."""
    return [range(rank * (p // world), (rank + 1) * (p // world)) for p in parts]


def qkv_ranges(layout: HeadLayout, rank: int, head_dim: int) -> list[range]:
    """Row ranges of q, k and v for rank's heads."""
    q, kv = layout.heads(rank), layout.kv_heads(rank)
    rows = lambda r: range(r.start * head_dim, r.stop * head_dim)
    return [rows(q), rows(kv), rows(kv)]


def vocab_range(vocab_size: int, rank: int, world: int) -> range:
    per = -(-vocab_size // world)
    return range(min(rank * per, vocab_size), min((rank + 1) * per, vocab_size))


def split_vocab(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's rows of an embedding or LM head [V, H], padded with zero rows to ceil(V / world)
    so that every rank's shard has one shape (the padding logits are cut after the gather)."""
    per = -(-w.shape[0] // world)
    r = vocab_range(w.shape[0], rank, world)
    out = w.new_zeros((per, w.shape[1]))
    out[:len(r)] = w[r.start:r.stop]
    return out


# --- a rank's group ------------------------------------------------------------------------
class TensorParallel:
    """A rank of a tensor-parallel group. `group` carries activations on `device`; `host` is a
    gloo group for CPU tensors (rank 0's commands, KV shards, the weights at startup)."""

    def __init__(self, rank: int, world: int, device: torch.device, group=None, host=None):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.group, self.host = group, host if host is not None else group
        self.layout: HeadLayout | None = None

    @classmethod
    def init(cls, rank: int, world: int, init_method: str, device: str | torch.device,
             timeout_s: float = COLLECTIVE_TIMEOUT_S) -> "TensorParallel":
        """Join the group at `init_method` (file:// or tcp://): every rank calls this."""
        device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
        host = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=HOST_TIMEOUT_S))
        return cls(rank, world, device, dist.group.WORLD, host)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Leave the group (gloo). NCCL communicators are left for the process's exit, which
        follows a rank's close: on two H200s both destroy_process_group and an abort of the
        group waited forever after a rank's last collective (perhaps because CUDA graphs captured
        them; not found out)."""
        if dist.is_initialized() and self.device.type != "cuda":
            dist.destroy_process_group()

    # activations (on the device; captured into CUDA graphs on a GPU)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n] on each rank -> [T, world * n], ranks in order along the last dim."""
        x = x.contiguous()
        if self.device.type == "cuda":
            out = torch.empty((self.world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, 0, group=self.group)
        return x

    # host data (CPU tensors, through gloo)
    def broadcast_host(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, 0, group=self.host)
        return x

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host)
        return int(t.item())

    def gather_host(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor of x's shape at rank 0 (None elsewhere)."""
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.is_leader else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.host)
        return parts


# --- a model's shard ------------------------------------------------------------------------
class RowParallelLinear(Linear):
    """A row-parallel shard: partial outputs summed over the ranks."""
    __slots__ = ("tp",)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.product(x))


class VocabParallelHead(Linear):
    """An output head split by vocabulary: each rank's logits, gathered in rank order and cut
    to the vocabulary (the last shard's padding rows dropped)."""
    __slots__ = ("tp", "vocab_size")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(self.product(x))
        return logits if logits.shape[-1] == self.vocab_size else logits[:, :self.vocab_size].contiguous()


def _with(cls, linear: Linear, weight, bias, **extra) -> Linear:
    out = cls(weight, bias, linear.parallel, ())
    for k, v in extra.items():
        setattr(out, k, v)
    return out


def place(t: torch.Tensor | None, device: torch.device, fill: bool = True) -> torch.Tensor | None:
    """A shard's tensor on `device`: a copy of `t` (no copy when it is already there and
    contiguous), or with `fill` off a new tensor of t's shape whose values are yet to come
    (`t` may then be on the meta device)."""
    if t is None:
        return None
    if not fill:
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return t.detach().contiguous().to(device)


def shard_linear(linear: Linear, tp: TensorParallel, rows: list[range] | None = None, fill: bool = True) -> Linear:
    """This rank's shard of a layer, by its `parallel` kind: column (each of its `parts`
    split evenly, or `rows` given per part), row (input split, outputs all-reduced, the bias
    added by rank 0), vocab (rows padded to one shape per rank, logits gathered) or replicated."""
    r, n, dev = tp.rank, tp.world, tp.device
    to = lambda t: place(t, dev, fill)
    kind = linear.parallel
    if kind == "column":
        parts = list(linear.parts or (linear.weight.shape[0],))
        rows = rows or even_ranges(parts, r, n)
        out = Linear(to(split_parts(linear.weight, parts, rows)), to(split_parts(linear.bias, parts, rows)),
                     "column", tuple(len(x) for x in rows) if linear.parts else ())
        return out
    if kind == "row":
        return _with(RowParallelLinear, linear, to(split_cols(linear.weight, r, n)),
                     to(linear.bias) if r == 0 else None, tp=tp)
    if kind == "vocab":
        bias = None if linear.bias is None else split_vocab(linear.bias[:, None], r, n)[:, 0]
        return _with(VocabParallelHead, linear, to(split_vocab(linear.weight.detach(), r, n)), to(bias),
                     tp=tp, vocab_size=linear.weight.shape[0])
    return Linear(to(linear.weight), to(linear.bias), kind, linear.parts)


def shard_model(model, tp: TensorParallel, fill: bool = True, layers=None):
    """Rank tp.rank's shard of a DecoderModel, on tp.device; the model itself is left as it
    was (its tensors stay shared with the shard where the shard's need no copy). Every layer
    is cut by its `parallel` kind; attention by heads (layout: check_layout). With `fill`
    off the shard's tensors are new and their values yet to come (engine/parallel/scatter.py), and
    the model's may be on the meta device. `layers`: an iterator of the model's layers, cut in
    place of model.layers one at a time as they come (each may be dropped once cut: dummy
    weights are made a layer at a time, engine/parallel/dummy_shard.py)."""
    from qmigrate.engine.layers.attention import Attention
    from qmigrate.engine.layers.moe import MoE
    if layers is None:
        first = next(layer.attn for layer in model.layers)
        widths = tuple(sorted({w for layer in model.layers for w in _mlp_widths(layer.mlp)}))
        tp.layout = check_layout(tp.world, first.num_heads, first.num_kv_heads, widths)
    # tensors shared by layers (rotary tables) move once; the source is kept with its copy, so
    # that its id is not reused while this runs (a layer that came from `layers` may be gone)
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def to(t):
        if id(t) not in moved:
            moved[id(t)] = (t, place(t, tp.device, fill))
        return moved[id(t)][1]

    def walk(obj):
        if isinstance(obj, Attention):
            return _shard_attention(copy.copy(obj), tp, to, fill)
        if isinstance(obj, MoE):
            return _shard_moe(copy.copy(obj), tp, fill)
        if isinstance(obj, Linear):
            return shard_linear(obj, tp, fill=fill)
        if isinstance(obj, torch.Tensor):
            return to(obj)
        obj = copy.copy(obj)
        for name in _fields(obj):
            value = getattr(obj, name)
            if value is not None and not isinstance(value, (int, float, str, bool)):
                setattr(obj, name, walk(value))
        return obj

    vocab = model.vocab_size
    model = copy.copy(model)
    model.vocab_rows = vocab_range(model.embed.shape[0], tp.rank, tp.world)
    model.embed = to(split_vocab(model.embed.detach(), tp.rank, tp.world))
    shards = []
    for layer in (model.layers if layers is None else layers):
        if layers is not None:   # each layer's widths checked as it comes
            tp.layout = check_layout(tp.world, layer.attn.num_heads, layer.attn.num_kv_heads,
                                     tuple(_mlp_widths(layer.mlp)))
        shards.append(walk(layer))
        del layer   # before the next is made
    model.layers = shards
    model.norm = walk(model.norm)
    model.lm_head = shard_linear(model.lm_head, tp, fill=fill)
    if model.embed_scale is not None:
        model.embed_scale = to(model.embed_scale)
    model.tp = tp
    model.device, model.vocab_size = tp.device, vocab
    return model


def _shard_attention(a, tp: TensorParallel, to, fill: bool):
    layout = tp.layout
    a.qkv = shard_linear(a.qkv, tp, qkv_ranges(layout, tp.rank, a.head_dim), fill)
    a.o = shard_linear(a.o, tp, fill=fill)
    a.num_heads, a.num_kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank
    a.cos, a.sin = to(a.cos), to(a.sin)
    for name in ("q_norm", "k_norm"):   # per head: the same on every rank
        norm = getattr(a, name)
        if norm is not None:
            setattr(a, name, dataclasses.replace(norm, weight=to(norm.weight)))
    return a


def _shard_moe(m, tp: TensorParallel, fill: bool):
    """Each expert's intermediate dim split (and the shared expert's), the router replicated;
    the layer all-reduces once the routed and shared partial outputs are added."""
    r, n = tp.rank, tp.world
    to = lambda t: place(t, tp.device, fill)
    width = m.gate_up.shape[1] // 2
    rows = even_ranges([width, width], r, n)
    m.gate_up = to(torch.cat([m.gate_up[:, width * i + s.start:width * i + s.stop] for i, s in enumerate(rows)], 1))
    m.down = to(m.down[:, :, rows[0].start:rows[0].stop])
    m.router = shard_linear(m.router, tp, fill=fill)
    if m.shared is not None:
        down = m.shared.down
        m.shared = copy.copy(m.shared)
        m.shared.gate_up = shard_linear(m.shared.gate_up, tp, fill=fill)
        # a partial sum, reduced with the routed experts' (the sigmoid gate scales it per token)
        m.shared.down = Linear(to(split_cols(down.weight, r, n)), to(down.bias) if r == 0 else None, "row")
        m.shared_gate = shard_linear(m.shared_gate, tp, fill=fill)
    m.tp = tp
    return m


def _fields(obj) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    raise LayoutError(f"cannot shard a {type(obj).__name__}: not a layer of engine/layers/")


def _mlp_widths(mlp) -> list[int]:
    """The widths the MLP's column-parallel layers split (their first part); a mixture of
    experts': each expert's, and its shared expert's."""
    from qmigrate.engine.layers.moe import MoE
    if isinstance(mlp, MoE):
        return [mlp.gate_up.shape[1] // 2] + (_mlp_widths(mlp.shared) if mlp.shared is not None else [])
    for name in _fields(mlp):
        value = getattr(mlp, name)
        if isinstance(value, Linear) and value.parallel == "column":
            return [(value.parts or value.weight.shape)[0]]
    raise LayoutError(f"{type(mlp).__name__} has no column-parallel layer")
