"""yunchang's call sites (0.6.4) on ringattn: change ``from yunchang import ...`` to
``from ringattn.compat.yunchang import ...``.

Legend: B batch, S global sequence, L local length (S / W), H heads, Hkv kv heads,
D head dim, W sequence-parallel ranks = R ring ranks x U Ulysses ranks, P all-to-all ranks.

What keeps yunchang's conventions:

* ``set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size,
  use_ulysses_low=True)`` and ``PROCESS_GROUP.ULYSSES_PG`` / ``PROCESS_GROUP.RING_PG``;
* the local splits ``EXTRACT_FUNC_DICT`` (``basic_extract_local``, ``stripe_extract_local``,
  ``zigzag_extract_local``): the same shards as yunchang's, element for element;
* ``LongContextAttention(ring_impl_type=...)`` and ``UlyssesAttention(group)``: the same
  constructor and forward arguments, the output [B, L, H, D] and its gradient;
* ``SeqAllToAll4D.apply(group, x, scatter_idx, gather_idx, use_sync)``: the same tensors.

What differs: the attention is ringattn's (``hybrid_attention`` on a ("ring", "ulysses")
DeviceMesh, ``ulysses_attention``), exact on every rank on CPU or CUDA, with any H, Hkv
(GQA/MQA with fewer kv heads than U), softcap and ALiBi; the "basic" splits may leave the
last rank short when S does not divide W. See docs/compat.md.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..strategies.hybrid import hybrid_attention
from ..strategies.ulysses import ulysses_attention
from ..validate import caller_error
from ..comm import HYBRID_DIMS, agree, all_to_all_single, group_members, mesh_groups
from ..layouts import SHARD_TAG, Contiguous, Layout, Segment, Striped, Zigzag, check_origin, check_tag, tag_shard

__all__ = [
    "AttnType",
    "EXTRACT_FUNC_DICT",
    "LongContextAttention",
    "PROCESS_GROUP",
    "SeqAllToAll4D",
    "UlyssesAttention",
    "all_to_all_4D",
    "basic_extract_local",
    "set_seq_parallel_pg",
    "stripe_extract_local",
    "zigzag_extract_local",
]


class AttnType(enum.Enum):
    """yunchang's local-kernel names. Every one is accepted and means the same thing here:
    ringattn picks its own exact local kernel (yunchang's Sage kernels quantise; these
    do not)."""

    AITER = "aiter"
    FA = "fa"
    FA3 = "fa3"
    FLASHINFER = "flashinfer"
    TORCH_MATH = "torch_math"
    TORCH_FLASH = "torch_flash"
    TORCH_EFFICIENT = "torch_efficient"
    TORCH_CUDNN = "torch_cudnn"
    SAGE_AUTO = "sage_auto"
    SAGE_FP16 = "sage_fp16"
    SAGE_FP16_TRITON = "sage_fp16_triton"
    SAGE_FP8 = "sage_fp8"
    SAGE_FP8_SM90 = "sage_fp8_sm90"
    SPARSE_SAGE = "sparse_sage"
    NPU = "npu"

    @classmethod
    def from_string(cls, s: str) -> "AttnType":
        for member in cls:
            if member.value == s:
                return member
        raise ValueError(f"{s!r} is not an AttnType; choose one of {[m.value for m in cls]}")


class _ProcessGroups:
    """yunchang's ``PROCESS_GROUP``: ``ULYSSES_PG`` and ``RING_PG`` of this rank, as
    ``set_seq_parallel_pg`` sets them, and the hybrid's DeviceMesh made from them
    (``MESH``, with ``RING_DEGREE``, ``ULYSSES_DEGREE``, ``USE_ULYSSES_LOW``)."""

    def __init__(self):
        self.ULYSSES_PG = None
        self.RING_PG = None
        self.MESH = None
        self.RING_DEGREE = None
        self.ULYSSES_DEGREE = None
        self.USE_ULYSSES_LOW = True


PROCESS_GROUP = _ProcessGroups()
"""The sequence-parallel groups of this process (yunchang keeps them in a module global as
well; ``set_seq_parallel_pg`` sets them, ``LongContextAttention`` reads them when built)."""


def _degree(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def set_seq_parallel_pg(sp_ulysses_degree: int, sp_ring_degree: int, rank: int,
                        world_size: int, use_ulysses_low: bool = True) -> None:
    """yunchang's group setup: the world is dp x (ring x Ulysses) ranks. Every rank calls it
    with the same arguments (it makes process groups).

    Arguments:
        sp_ulysses_degree: U, the ranks of one all-to-all (heads <-> sequence).
        sp_ring_degree: R, the ranks of one ring.
        rank, world_size: this process's global rank and the world's size; world_size must
            be a multiple of U * R (the rest is data parallelism, dp = world / (U * R)).
        use_ulysses_low: True: a Ulysses group is U consecutive ranks (one node's, the
            usual choice) and a ring group strides over them; False: the other way round.

    Sets ``PROCESS_GROUP.ULYSSES_PG`` and ``PROCESS_GROUP.RING_PG`` to yunchang's groups
    (the same ranks), and ``PROCESS_GROUP.MESH`` to the ("ring", "ulysses") DeviceMesh of
    this rank's dp replica that ``LongContextAttention`` attends over: its Ulysses dimension
    is always U consecutive ranks (ringattn's hybrid takes its shards in rank order); with
    ``use_ulysses_low=False`` the shards that yunchang's splits make there are still
    attended exactly, the all-to-all just runs within consecutive ranks.

    Raises:
        ValueError: a degree that is not a positive int, or world_size not a multiple of
            U * R, or rank / world_size not this process's.
    """
    from torch.distributed.device_mesh import DeviceMesh

    u = _degree("sp_ulysses_degree", sp_ulysses_degree)
    r = _degree("sp_ring_degree", sp_ring_degree)
    if world_size != dist.get_world_size() or rank != dist.get_rank():
        raise ValueError(f"rank={rank}, world_size={world_size} are not this process's "
                         f"(rank {dist.get_rank()} of {dist.get_world_size()})")
    sp = u * r
    if world_size % sp:
        raise ValueError(f"world_size {world_size} is not a multiple of sp_ulysses_degree "
                         f"{u} x sp_ring_degree {r} = {sp}")
    dp = world_size // sp
    device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    ranks = torch.arange(world_size)
    if dp == 1:
        mesh = DeviceMesh(device, ranks.view(r, u), mesh_dim_names=HYBRID_DIMS)
    else:
        mesh = DeviceMesh(device, ranks.view(dp, r, u), mesh_dim_names=("dp", *HYBRID_DIMS))
        mesh = mesh[HYBRID_DIMS]
    if use_ulysses_low:  # yunchang's groups are the mesh's own
        uly_pg, ring_pg = mesh["ulysses"].get_group(), mesh["ring"].get_group()
    else:  # yunchang's strided Ulysses groups, made in its order on every rank
        uly_pg = ring_pg = None
        for offset in range(0, world_size, sp):
            for i in range(u):
                members = list(range(offset + i * r, offset + (i + 1) * r))
                group = dist.new_group(members)
                if rank in members:
                    ring_pg = group
            for i in range(r):
                members = list(range(offset + i, offset + sp, r))
                group = dist.new_group(members)
                if rank in members:
                    uly_pg = group
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG, PROCESS_GROUP.MESH = uly_pg, ring_pg, mesh
    PROCESS_GROUP.RING_DEGREE, PROCESS_GROUP.ULYSSES_DEGREE = r, u
    PROCESS_GROUP.USE_ULYSSES_LOW = bool(use_ulysses_low)


# ---------------------------------------------------------------- the local splits


@dataclass(frozen=True)
class _Pieces(Layout):
    """A layout over R ring ranks (``ring``) whose every ring rank's L_R local slots are cut
    into U consecutive pieces of L = L_R / U; piece (ring r, Ulysses u) lives on shard
    r * U + u (``ulysses_low``) or u * R + r. It is yunchang's zigzag and stripe split: its
    Ulysses all-to-all gathers ring rank r's slots in piece order, and its ring then runs
    the ring layout over R."""

    ring: Layout = field(default_factory=Zigzag, kw_only=True)
    R: int = field(default=1, kw_only=True)
    U: int = field(default=1, kw_only=True)
    ulysses_low: bool = field(default=True, kw_only=True)
    name: str = ""

    def __post_init__(self):  # the ring's name, which is what ranks agree on
        object.__setattr__(self, "name", self.ring.name)

    @property
    def unit_stride(self) -> bool:  # type: ignore[override]
        return self.ring.unit_stride

    def multiple(self, world: int) -> int:
        m = self.ring.multiple(self.R)
        return m * world // math.gcd(m, world)

    def place(self, shard: int) -> tuple[int, int]:
        """(ring rank, Ulysses rank) of the piece on ``shard``."""
        return divmod(shard, self.U) if self.ulysses_low else (shard % self.R, shard // self.R)

    def segments(self, rank: int, world: int, padded: int) -> tuple[Segment, ...]:
        r, u = self.place(rank)
        n = padded // world
        lo, hi = u * n, (u + 1) * n
        out = []
        for s in self.ring.segments(r, self.R, padded):
            a, b = max(lo, s.local_start), min(hi, s.local_start + s.length)
            if a < b:
                out.append(Segment(a - lo, b - a, s.global_start + (a - s.local_start) * s.stride,
                                   s.stride))
        return tuple(out)


_RING_LAYOUTS = {"basic": Contiguous(), "basic_pytorch": Contiguous(),
                 "basic_flashinfer": Contiguous(), "basic_npu": Contiguous(),
                 "zigzag": Zigzag(), "strip": Striped()}
"""yunchang's ``ring_impl_type`` -> the layout of its ring over R ranks."""


def _placement(ring_impl_type: str, r: int, u: int, ulysses_low: bool) -> Layout:
    """The layout over W = R * U sequence-parallel shards (in rank order) of the shards that
    ``EXTRACT_FUNC_DICT[ring_impl_type]`` makes."""
    ring = _RING_LAYOUTS[ring_impl_type]
    if isinstance(ring, Contiguous) or r == 1:  # chunk(W)[rank]; one ring rank: its pieces
        return Contiguous()
    if u == 1:
        return ring
    # the stripe split places pieces by global rank, the zigzag split by group rank
    low = ulysses_low or isinstance(ring, Striped)
    return _Pieces(ring=ring, R=r, U=u, ulysses_low=low)


def _take(value: torch.Tensor, layout: Layout, shard: int, world: int, what: str) -> torch.Tensor:
    """Slots of ``shard`` on dim 1 of ``value`` (S must fill the layout: no padding)."""
    if value.dim() < 2:
        raise ValueError(f"{what} takes a tensor [B, S, ...], got shape {tuple(value.shape)}")
    s = value.shape[1]
    if layout.padded_len(s, world) != s:
        raise ValueError(f"{what}: S={s} on dim 1 must be a multiple of {layout.multiple(world)} "
                         f"for this split over {world} ranks (the basic split takes any S)")
    from ..layouts import local_positions

    return value.index_select(1, local_positions(layout, shard, world, s).to(value.device))


def _groups_degrees(rd: int, ud: int, what: str) -> None:
    if PROCESS_GROUP.MESH is None:
        raise ValueError(f"{what} reads the groups of set_seq_parallel_pg: call "
                         f"ringattn.compat.yunchang.set_seq_parallel_pg first")
    if (dist.get_world_size(PROCESS_GROUP.RING_PG), dist.get_world_size(PROCESS_GROUP.ULYSSES_PG)) \
            != (rd, ud):
        raise ValueError(f"{what}: rd={rd}, ud={ud} but set_seq_parallel_pg made ring groups "
                         f"of {dist.get_world_size(PROCESS_GROUP.RING_PG)} and Ulysses groups "
                         f"of {dist.get_world_size(PROCESS_GROUP.ULYSSES_PG)} ranks")


def _tagged(out: torch.Tensor, layout: Layout, shard: int, world: int, seqlen: int):
    """``out`` with a shard tag (as ``ringattn.shard`` sets): ringattn then refuses it when it
    is attended or gathered with another placement. Tagged when the split's ranks are the
    world's or the sequence-parallel mesh's (the groups it can be attended over)."""
    groups = [dist.group.WORLD]
    if PROCESS_GROUP.MESH is not None:
        groups.insert(0, mesh_groups(PROCESS_GROUP.MESH)[0])
    for pg in groups:
        if dist.get_world_size(pg) == world:
            return tag_shard(out, layout, seqlen, -2, 1, group_members(pg), shard)
    return out


def basic_extract_local(value: torch.Tensor, rank: int, world_size: int, *args, **kwargs):
    """yunchang's "basic" split: ``value.chunk(world_size, dim=1)[rank]``, detached (the
    last rank is short when S does not divide world_size).

    Raises:
        ValueError: S so small that chunk() makes fewer than world_size pieces.
    """
    pieces = value.chunk(world_size, dim=1)
    if len(pieces) != world_size:
        raise ValueError(f"S={value.shape[1]} cut into chunks of "
                         f"{-(-value.shape[1] // world_size)} gives {len(pieces)} pieces, not "
                         f"one per rank of {world_size}")
    return _tagged(pieces[rank].detach().clone(), Contiguous(), rank, world_size, value.shape[1])


def stripe_extract_local(value: torch.Tensor, rank: int, world_size: int, rd: int, ud: int,
                         *args, **kwargs):
    """yunchang's "strip" split: ring rank r's tokens are r, r + rd, r + 2 rd, ...; the
    ring rank's tokens are cut into ud consecutive pieces, piece u on global rank r*ud+u.

    Raises:
        ValueError: S not a multiple of world_size, or set_seq_parallel_pg not called.
    """
    _groups_degrees(rd, ud, "stripe_extract_local")
    lay = _placement("strip", rd, ud, True)
    return _tagged(_take(value, lay, rank, world_size, "stripe_extract_local"), lay, rank,
                   world_size, value.shape[1])


def zigzag_extract_local(value: torch.Tensor, rank: int, world_size: int, rd: int, ud: int,
                         dim: int = 1, *args, **kwargs):
    """yunchang's "zigzag" split: 2 rd chunks, ring rank r holds chunks r and 2rd-1-r,
    cut into ud consecutive pieces, piece u on the rank with Ulysses-group rank u.

    Raises:
        ValueError: dim other than 1, S not a multiple of 2 rd and world_size, or
            set_seq_parallel_pg not called.
    """
    if dim != 1:
        raise ValueError(f"zigzag_extract_local splits dim 1 of [B, S, ...], got dim={dim}")
    _groups_degrees(rd, ud, "zigzag_extract_local")
    lay = _placement("zigzag", rd, ud, PROCESS_GROUP.USE_ULYSSES_LOW)
    r, u = dist.get_rank(PROCESS_GROUP.RING_PG), dist.get_rank(PROCESS_GROUP.ULYSSES_PG)
    shard = r * ud + u if PROCESS_GROUP.USE_ULYSSES_LOW or ud == 1 or rd == 1 else u * rd + r
    return _tagged(_take(value, lay, shard, world_size, "zigzag_extract_local"), lay, shard,
                   world_size, value.shape[1])


EXTRACT_FUNC_DICT = {
    "basic": basic_extract_local,
    "strip": stripe_extract_local,
    "zigzag": zigzag_extract_local,
    "basic_pytorch": basic_extract_local,
    "basic_flashinfer": basic_extract_local,
    "basic_npu": basic_extract_local,
}
"""yunchang's ``ring_impl_type`` -> the split that makes its shards."""


# ---------------------------------------------------------------- the all-to-all


def all_to_all_4D(input: torch.Tensor, scatter_idx: int = 2, gather_idx: int = 1, group=None,
                  use_sync: bool = False) -> torch.Tensor:
    """yunchang's 4-D all-to-all over ``group`` (None: the world) of P ranks.

    scatter_idx=2, gather_idx=1: [B, S/P, H, D] (this rank's tokens, all heads) ->
    [B, S, H/P, D] (every rank's tokens in rank order, this rank's H/P heads).
    scatter_idx=1, gather_idx=2: the inverse.

    Raises:
        ValueError: not 4-D, another pair of indices, or H (resp. S) not a multiple of P.
    """
    if input.dim() != 4:
        raise ValueError(f"all_to_all_4D takes a 4-D tensor, got shape {tuple(input.shape)}")
    p = dist.get_world_size(group)
    b, n, h, d = input.shape
    if (scatter_idx, gather_idx) == (2, 1):
        if h % p:
            raise ValueError(f"scatter_idx=2 splits {h} heads over {p} ranks: not a multiple")
        send = input.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4)  # [P_dst, B, n, h, D]
    elif (scatter_idx, gather_idx) == (1, 2):
        if n % p:
            raise ValueError(f"scatter_idx=1 splits S={n} over {p} ranks: not a multiple")
        send = input.reshape(b, p, n // p, h, d).permute(1, 0, 2, 3, 4)  # [P_dst, B, n/P, H, D]
    else:
        raise ValueError(f"(scatter_idx, gather_idx) must be (2, 1) or (1, 2), got "
                         f"({scatter_idx}, {gather_idx})")
    send = send.contiguous()
    if p == 1:
        recv = send
    else:
        recv = torch.empty_like(send)
        all_to_all_single(recv, send, None, None, group if group is not None else dist.group.WORLD,
                          what="SeqAllToAll4D")
        if use_sync and recv.is_cuda:
            torch.cuda.synchronize()
    if scatter_idx == 2:  # [P_src, B, n, h, D] -> [B, P_src * n, h, D]
        return recv.permute(1, 0, 2, 3, 4).reshape(b, p * n, h // p, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n // p, p * h, d)  # heads in P_src order


class SeqAllToAll4D(torch.autograd.Function):
    """``SeqAllToAll4D.apply(group, input, scatter_idx, gather_idx, use_sync=False)``:
    ``all_to_all_4D`` whose backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, group, input, scatter_idx, gather_idx, use_sync=False):
        ctx.args = (group, gather_idx, scatter_idx, use_sync)
        return all_to_all_4D(input, scatter_idx, gather_idx, group=group, use_sync=use_sync)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_idx, gather_idx, use_sync = ctx.args
        return (None, SeqAllToAll4D.apply(group, grad, scatter_idx, gather_idx, use_sync),
                None, None, None)


# ---------------------------------------------------------------- the attention modules


def _check_indices(scatter_idx, gather_idx, what: str) -> None:
    if (scatter_idx, gather_idx) != (2, 1):
        raise ValueError(f"{what} takes sequence-sharded [B, L, H, D] inputs: scatter_idx=2, "
                         f"gather_idx=1 (yunchang's defaults), got ({scatter_idx}, {gather_idx})")


def _attn_type(attn_type) -> AttnType:
    if isinstance(attn_type, AttnType):
        return attn_type
    value = getattr(attn_type, "value", attn_type)  # yunchang's own enum works too
    return AttnType.from_string(value)


def _agreed_length(q, pg, layout: Layout, local_error: Exception | None) -> int:
    """S, the sum of every rank's local length, agreed by every rank in one small exchange
    and checked against ``layout`` over the group's W ranks; the same error on every rank
    when a rank failed its local checks (``local_error``) or the lengths do not form the
    layout's shards."""
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    n = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else -1
    lengths = agree(pg, {"local_len": n}, local_error, what="yunchang's local lengths",
                    per_rank=("local_len",))["local_len"]
    s = sum(lengths)
    padded, local = layout.padded_len(s, world), layout.local_len(s, world)
    if isinstance(layout, Contiguous):
        expected = [max(0, min(local, s - j * local)) for j in range(world)]
    else:
        expected = [local] * world if padded == s else None
    if lengths != expected:
        raise ValueError(
            f"the ranks hold {lengths} tokens (dim 1 of [B, L, H, D]), which is not the "
            f"{layout.name!r} split of S={s} over {world} ranks"
            + ("" if isinstance(layout, Contiguous) else
               f" (S must be a multiple of {layout.multiple(world)})")
            + f"; make the shards with this module's EXTRACT_FUNC_DICT (rank {me} holds {n})")
    return s


def _padded_call(fn, q, k, v, s: int, layout: Layout, world: int, **kwargs) -> torch.Tensor:
    """``fn`` on shards padded to the layout's local length (the short last rank of the
    basic split), the output cut back to this rank's tokens."""
    n, local = q.shape[1], layout.local_len(s, world)
    if n < local:
        q, k, v = (torch.cat([t, t.new_zeros(t.shape[0], local - n, *t.shape[2:])], dim=1)
                   for t in (q, k, v))
    out = fn(q, k, v, layout=layout, seqlen=s, **kwargs)
    return out[:, :n] if n < local else out


def _local_error(q, k, v, dropout_p, layout: Layout, pg, seqlen) -> Exception | None:
    """This rank's own problem with the call (reported on every rank by the agreement)."""
    if any(not isinstance(t, torch.Tensor) for t in (q, k, v)):
        return TypeError("query, key and value must be torch.Tensors")
    if q.dim() != 4:
        return ValueError(f"query must be [B, L, H, D], got shape {tuple(q.shape)}")
    if dropout_p != 0:
        return ValueError(f"dropout_p={dropout_p}: attention dropout is not supported "
                          f"(ringattn is exact attention); pass 0")
    for name, t in (("query", q), ("key", k), ("value", v)):
        tag = getattr(t, SHARD_TAG, None)
        if tag is None:
            continue
        try:  # S: the shard's own when the call does not say (checked by the agreement)
            check_origin(name, t, group_members(pg), "attended")
            check_tag(name, t, layout, tag.seqlen if seqlen is None else seqlen, -2,
                      dist.get_rank(pg), dist.get_world_size(pg), "attended by this module")
        except ValueError as exc:
            return exc
    return None


class _Attention(torch.nn.Module):
    """The forward of both modules: yunchang's arguments -> one ringattn call."""

    def _attend(self, fn, group, lengths_pg, layout, query, key, value, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, seqlen):
        error = _local_error(query, key, value, dropout_p, layout, lengths_pg, seqlen)
        if seqlen is None:
            seqlen, error = _agreed_length(query, lengths_pg, layout, error), None
        with caller_error(error):  # reported by the attention's agreement, on every rank
            return _padded_call(fn, query, key, value, seqlen, layout,
                                dist.get_world_size(lengths_pg), group=group, causal=causal,
                                window_size=tuple(window_size), softmax_scale=softmax_scale,
                                softcap=softcap, alibi_slopes=alibi_slopes)


class UlyssesAttention(_Attention):
    """yunchang's Ulysses layer: each rank passes its contiguous shard
    (``q.chunk(W, dim=1)[rank]``) and gets the output for it; ringattn's
    ``ulysses_attention`` computes it exactly, with any H and Hkv and any S (the last rank
    short when S does not divide W).

    Arguments:
        sequence_process_group: the W ranks (None: the world).
        scatter_idx, gather_idx: 2 and 1 (sequence-sharded inputs), yunchang's defaults.
        use_sync: accepted (a CUDA synchronisation in yunchang; nothing to do here).
        attn_type: any ``AttnType``: ringattn picks its own exact local kernel.

    Raises:
        ValueError: other scatter/gather indices, an unknown attn_type.
    """

    def __init__(self, sequence_process_group=None, scatter_idx: int = 2, gather_idx: int = 1,
                 use_sync: bool = False, attn_type: AttnType = AttnType.FA) -> None:
        super().__init__()
        _check_indices(scatter_idx, gather_idx, "UlyssesAttention")
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx, self.use_sync = scatter_idx, gather_idx, use_sync
        self.attn_type = _attn_type(attn_type)

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *args, seqlen=None):
        """Attention over the whole sequence for this rank's queries.

        Arguments:
            query: [B, L, H, D]; key, value: [B, L, Hkv, D] (this rank's contiguous shard).
            dropout_p: 0 only. softmax_scale, causal, window_size, softcap, alibi_slopes
                ([H]): flash-attn's, in global positions. deterministic,
                return_attn_probs: accepted (the output alone is returned, as yunchang).
            seqlen: ringattn's addition, the global S. None: S is the sum of the ranks'
                local lengths, found by one small agreement of them (a round trip each
                call); given (the same on every rank), nothing is exchanged before the
                attention's own agreement, which also carries this module's refusals
                (dropout, a shard of another split), so every rank raises them.

        Returns:
            out [B, L, H, D] in query's dtype.

        Raises:
            ValueError: dropout, or shards that are not the contiguous split (the same
                error on every rank, before the attention's collectives).
        """
        pg = self.spg if self.spg is not None else dist.group.WORLD
        return self._attend(ulysses_attention, pg, pg, Contiguous(), query, key, value,
                            dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, seqlen)


class LongContextAttention(_Attention):
    """yunchang's USP layer (Ulysses within ``PROCESS_GROUP.ULYSSES_PG``, the ring across):
    ringattn's ``hybrid_attention`` on ``PROCESS_GROUP.MESH``, attending exactly the shards
    that ``EXTRACT_FUNC_DICT[ring_impl_type]`` makes.

    Arguments:
        scatter_idx, gather_idx: 2 and 1 (sequence-sharded inputs), yunchang's defaults.
        ring_impl_type: which split the shards come from: "basic" (and "basic_pytorch",
            "basic_flashinfer", "basic_npu": contiguous), "zigzag" or "strip".
        use_pack_qkv, use_sync: accepted (how yunchang moves q, k, v; the result is the
            same).
        attn_type: any ``AttnType``: ringattn picks its own exact local kernel.
        attn_processor: None only.

    Raises:
        ValueError: set_seq_parallel_pg not called, an unknown ring_impl_type or attn_type,
            an attn_processor, other scatter/gather indices (on every rank: each builds
            the module with the same arguments).
    """

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_pack_qkv: bool = False, use_sync: bool = False,
                 attn_type: AttnType = AttnType.FA, attn_processor=None) -> None:
        super().__init__()
        _check_indices(scatter_idx, gather_idx, "LongContextAttention")
        if ring_impl_type not in _RING_LAYOUTS:
            raise ValueError(f"unknown ring_impl_type {ring_impl_type!r}; choose one of "
                             f"{list(_RING_LAYOUTS)}")
        if attn_processor is not None:
            raise ValueError(f"attn_processor={type(attn_processor).__name__}: a custom local "
                             f"attention (Sparse Sage) is not supported; pass None")
        if PROCESS_GROUP.MESH is None:
            raise ValueError("LongContextAttention attends over the groups of "
                             "set_seq_parallel_pg: call ringattn.compat.yunchang."
                             "set_seq_parallel_pg(ulysses_degree, ring_degree, rank, "
                             "world_size) first")
        self.ring_pg, self.ulysses_pg = PROCESS_GROUP.RING_PG, PROCESS_GROUP.ULYSSES_PG
        self.mesh = PROCESS_GROUP.MESH
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.ring_impl_type = ring_impl_type
        self.use_pack_qkv, self.use_sync = use_pack_qkv, use_sync
        self.attn_type = _attn_type(attn_type)
        self.layout = _placement(ring_impl_type, PROCESS_GROUP.RING_DEGREE,
                                 PROCESS_GROUP.ULYSSES_DEGREE, PROCESS_GROUP.USE_ULYSSES_LOW)
        self._flat = mesh_groups(self.mesh)[0]

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *args, seqlen=None):
        """Attention over the whole sequence for this rank's queries.

        Arguments:
            query: [B, L, H, D]; key, value: [B, L, Hkv, D]: this rank's shard as
                ``EXTRACT_FUNC_DICT[ring_impl_type]`` makes it. Any H and Hkv (yunchang
                needs both to divide by U).
            dropout_p: 0 only. softmax_scale, causal, window_size, softcap, alibi_slopes
                ([H]): flash-attn's, in global positions. deterministic,
                return_attn_probs: accepted (the output alone is returned, as yunchang).
            seqlen: ringattn's addition, the global S. None: S is the sum of the ranks'
                local lengths, found by one small agreement of them (a round trip each
                call); given (the same on every rank), nothing is exchanged before the
                attention's own agreement, which also carries this module's refusals
                (dropout, a shard of another split), so every rank raises them.

        Returns:
            out [B, L, H, D] in query's dtype.

        Raises:
            ValueError: dropout, or shards that are not the split of ring_impl_type (the
                same error on every rank, before the attention's collectives).
        """
        return self._attend(hybrid_attention, self.mesh, self._flat, self.layout, query, key,
                            value, dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, seqlen)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
