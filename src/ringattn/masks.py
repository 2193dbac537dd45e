"""Masks as functions of GLOBAL positions, and their classification on blocks.

A mask says whether query position q may see key position kv. The ring never builds a
global mask: for each pair of local segments (see ``layouts.Segment``) it asks the mask to
classify the block they form as EMPTY (skip it), FULL (unmasked kernel) or PARTIAL (a band
the kernel applies), trimmed to the rows and columns that see anything.

A band ``Band(lo, hi)`` over a block's local row i and column j means: visible iff
``lo <= i - j <= hi`` (``None`` for an unbounded side). ``Band(0, None)`` is the top-left
aligned causal triangle that fused kernels run natively.
"""

from __future__ import annotations

import enum
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from .layouts import Segment

__all__ = [
    "Mask",
    "causal",
    "sliding_window",
    "document",
    "prefix_lm",
    "key_padding",
    "key_mask",
    "chunked",
    "dilated",
    "from_function",
    "full",
    "BlockKind",
    "Band",
    "Block",
    "BlockMask",
    "WindowMask",
    "evaluate",
]


class BlockKind(enum.Enum):
    EMPTY = "empty"
    FULL = "full"
    PARTIAL = "partial"


@dataclass(frozen=True)
class Band:
    """Visible iff lo <= i - j <= hi on block-local row i and column j (None: unbounded)."""

    lo: int | None
    hi: int | None

    @property
    def is_causal(self) -> bool:
        """True for the top-left aligned causal triangle (j <= i)."""
        return self.lo == 0 and self.hi is None

    def dense(self, rows: range, cols: range, device=None) -> torch.Tensor:
        """Boolean [len(rows), len(cols)] visibility for the given block-local rows and cols."""
        i = torch.arange(rows.start, rows.stop, device=device)[:, None]
        j = torch.arange(cols.start, cols.stop, device=device)[None, :]
        d = i - j
        ok = torch.ones(d.shape, dtype=torch.bool, device=device)
        if self.lo is not None:
            ok &= d >= self.lo
        if self.hi is not None:
            ok &= d <= self.hi
        return ok

    def cols_for_rows(self, row_start: int, row_stop: int, ncols: int) -> tuple[int, int]:
        """Smallest column range [start, stop) holding every visible column of these rows."""
        start = 0 if self.hi is None else max(0, row_start - self.hi)
        stop = ncols if self.lo is None else min(ncols, row_stop - 1 - self.lo + 1)
        return start, max(start, stop)


@dataclass(frozen=True)
class Block:
    """What one (q-segment, kv-segment) pair needs, in local buffer coordinates.

    Rows [q_start, q_stop) of the local queries against columns [k_start, k_stop) of the
    visiting keys; ``mask`` is None for FULL blocks, else a ``Band`` or a ``BlockMask``.
    """

    kind: BlockKind
    q_start: int = 0
    q_stop: int = 0
    k_start: int = 0
    k_stop: int = 0
    mask: "Band | BlockMask | None" = None


EMPTY_BLOCK = Block(BlockKind.EMPTY)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WindowMask:
    """Causal / sliding-window / padding mask in global positions.

    q sees kv iff both are < seqlen and q - left <= kv <= q + right (None: unbounded).
    Causal is right = 0.
    """

    seqlen: int
    left: int | None = None
    right: int | None = None

    def __call__(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Elementwise visibility of broadcastable global position tensors."""
        ok = (q_pos < self.seqlen) & (kv_pos < self.seqlen)
        if self.left is not None:
            ok = ok & (kv_pos >= q_pos - self.left)
        if self.right is not None:
            ok = ok & (kv_pos <= q_pos + self.right)
        return ok

    def classify(self, qseg: Segment, kseg: Segment) -> Block:
        """Classify the block of two segments and trim it to its visible rows and columns."""
        if qseg.stride != kseg.stride:
            raise ValueError(
                f"segments with strides {qseg.stride} and {kseg.stride} cannot form a band"
            )
        st = qseg.stride
        nq = qseg.valid_length(self.seqlen)
        nk = kseg.valid_length(self.seqlen)
        if nq == 0 or nk == 0:
            return EMPTY_BLOCK
        # global q - kv = delta + st * (i - j); the window bounds q - kv to [-right, left].
        delta = qseg.global_start - kseg.global_start
        lo = None if self.right is None else _ceil_div(-self.right - delta, st)
        hi = None if self.left is None else (self.left - delta) // st
        # rows with at least one visible column, and columns with at least one visible row
        i0 = 0 if lo is None else max(0, lo)
        i1 = nq if hi is None else min(nq, hi + nk)
        j0 = 0 if hi is None else max(0, -hi)
        j1 = nk if lo is None else min(nk, nq - lo)
        if (lo is not None and hi is not None and lo > hi) or i0 >= i1 or j0 >= j1:
            return EMPTY_BLOCK
        shift = i0 - j0  # i - j = (i' - j') + shift in trimmed coordinates
        lo_t = None if lo is None or lo - shift <= -(j1 - j0 - 1) else lo - shift
        hi_t = None if hi is None or hi - shift >= i1 - i0 - 1 else hi - shift
        band = None if lo_t is None and hi_t is None else Band(lo_t, hi_t)
        return Block(
            BlockKind.FULL if band is None else BlockKind.PARTIAL,
            qseg.local_start + i0,
            qseg.local_start + i1,
            kseg.local_start + j0,
            kseg.local_start + j1,
            band,
        )


# ---------------------------------------------------------------------------------------
# Masks users write: functions of GLOBAL (batch, head, q_pos, kv_pos), composable with & |.
# ---------------------------------------------------------------------------------------


class Mask:
    """Visibility as a function of global (batch, head, q_pos, kv_pos), like flex's mask_mod.

    ``mask(b, h, q, kv)`` takes integer tensors that broadcast against each other (the plan
    passes ``b`` [B,1,1,1], ``h`` [1,H,1,1], ``q`` [1,1,Sq,1], ``kv`` [1,1,1,Sk]; only when
    a plan's partial tiles are too many to store does flex call it with 0-d tensors) and
    returns a bool tensor of their broadcast shape. Positions are global,
    so a mask written for the whole sequence works unchanged on shards. Combine masks with
    ``&`` (both allow) and ``|`` (either allows).

    A mask must be a pure function of its arguments: the ring classifies blocks once per
    (mask, layout, S, W, B, H) and reuses the result across calls, forward and backward.
    """

    band: tuple[int | None, int | None] | None = None
    """(left, right) when the mask is exactly ``left >= q - kv >= -right`` (None: unbounded
    side); such masks are classified analytically on regular layouts."""

    def __call__(self, b, h, q, kv) -> torch.Tensor:
        raise NotImplementedError

    def key(self):
        """A hashable value identifying what the mask computes (its cache key)."""
        return self

    def __and__(self, other: "Mask") -> "Mask":
        return _combine(self, other, "and")

    def __or__(self, other: "Mask") -> "Mask":
        return _combine(self, other, "or")

    def __hash__(self):
        k = self.key()
        return id(self) if k is self else hash(k)

    def __eq__(self, other):
        if not isinstance(other, Mask):
            return NotImplemented
        k = self.key()
        return self is other if k is self else k == other.key()


class _Band(Mask):
    def __init__(self, left: int | None, right: int | None):
        self.band = (left, right)

    def key(self):
        return ("band", self.band)

    def __call__(self, b, h, q, kv):
        left, right = self.band
        ok = torch.ones((), dtype=torch.bool, device=q.device).expand(torch.broadcast_shapes(q.shape, kv.shape))
        if left is not None:
            ok = ok & (kv >= q - left)
        if right is not None:
            ok = ok & (kv <= q + right)
        return ok

    def __repr__(self):
        return f"band(left={self.band[0]}, right={self.band[1]})"


def full() -> Mask:
    """Every query sees every key (the identity of ``&``)."""
    return _Band(None, None)


def causal() -> Mask:
    """Query q sees key kv iff kv <= q."""
    return _Band(None, 0)


def sliding_window(left: int, right: int = 0) -> Mask:
    """flash-attn's window: query q sees key kv iff q - left <= kv <= q + right.

    ``right=0`` (the default) is a causal sliding window; -1 on either side is unbounded.
    """
    for name, x in (("left", left), ("right", right)):
        if not isinstance(x, int) or isinstance(x, bool) or x < -1:
            raise ValueError(f"sliding_window {name} must be an int >= 0 or -1, got {x!r}")
    return _Band(None if left < 0 else left, None if right < 0 else right)


class _Combined(Mask):
    def __init__(self, parts: tuple[Mask, ...], op: str):
        self.parts, self.op = parts, op
        if op == "and" and all(p.band is not None for p in parts):
            lefts = [p.band[0] for p in parts if p.band[0] is not None]
            rights = [p.band[1] for p in parts if p.band[1] is not None]
            self.band = (min(lefts) if lefts else None, min(rights) if rights else None)

    def key(self):
        return (self.op, tuple(p.key() for p in self.parts))

    def __call__(self, b, h, q, kv):
        result = None
        for p in self.parts:
            r = p(b, h, q, kv)
            result = r if result is None else (result & r if self.op == "and" else result | r)
        return result

    def __repr__(self):
        return "(" + f" {'&' if self.op == 'and' else '|'} ".join(map(repr, self.parts)) + ")"


def _combine(a: Mask, b: Mask, op: str) -> Mask:
    if not isinstance(a, Mask) or not isinstance(b, Mask):
        raise TypeError(f"masks combine with masks, not {type(b).__name__}")
    parts = []
    for m in (a, b):
        parts.extend(m.parts if isinstance(m, _Combined) and m.op == op else (m,))
    return _Combined(tuple(parts), op)


def _int_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {x.dtype} shape {tuple(x.shape)}")
        return x.detach().to("cpu", torch.int64)
    if isinstance(x, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        return torch.tensor(x, dtype=torch.int64)
    raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {type(x).__name__}")


def check_cu_seqlens(cu_seqlens, seqlen: int | None = None) -> tuple[int, ...]:
    """Validate flash-attn style cu_seqlens [0, end_0, end_1, ..., S]; return them as a tuple.

    Raises:
        TypeError: not an integer sequence. ValueError: not starting at 0, not strictly
            increasing, or (given ``seqlen``) not ending at S.
    """
    cu = _int_tensor(cu_seqlens, "cu_seqlens")
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries [0, ..., S], got {cu.tolist()}")
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    steps = cu[1:] - cu[:-1]
    if bool((steps <= 0).any()):
        i = int(torch.nonzero(steps <= 0)[0])
        raise ValueError(
            f"cu_seqlens must be strictly increasing, but entry {i + 1} ({int(cu[i + 1])}) "
            f"follows {int(cu[i])}"
        )
    if seqlen is not None and int(cu[-1]) != seqlen:
        raise ValueError(f"cu_seqlens must end at S={seqlen}, but ends at {int(cu[-1])}")
    return tuple(cu.tolist())


class _Document(Mask):
    def __init__(self, cu: tuple[int, ...]):
        self.cu = cu
        lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
        self._doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
        self._on: dict = {}

    def key(self):
        return ("document", self.cu)

    def doc_ids(self, device) -> torch.Tensor:
        """[S] int32: the document of every global position, on ``device``."""
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = self._doc.to(device)
        return self._on[device]

    def __call__(self, b, h, q, kv):
        doc = self.doc_ids(q.device)
        last = doc.numel() - 1
        return doc[q.clamp(0, last)] == doc[kv.clamp(0, last)]

    def __repr__(self):
        return f"document({len(self.cu) - 1} documents, S={self.cu[-1]})"


def document(cu_seqlens) -> Mask:
    """Packed documents: q sees kv iff both lie in the same document.

    Arguments:
        cu_seqlens: [n_docs + 1] ints, flash-attn's convention: document d holds global
            positions [cu_seqlens[d], cu_seqlens[d+1]); starts at 0, strictly increasing,
            ends at S.
    """
    return _Document(check_cu_seqlens(cu_seqlens))


class _PrefixLM(Mask):
    def __init__(self, prefix):
        self.prefix = prefix
        self._t = torch.tensor(prefix, dtype=torch.int64) if isinstance(prefix, tuple) else None

    def key(self):
        return ("prefix_lm", self.prefix)

    def __call__(self, b, h, q, kv):
        n = self.prefix if self._t is None else self._t.to(q.device)[b]
        return (kv < n) | (kv <= q)

    def __repr__(self):
        return f"prefix_lm({self.prefix})"


def prefix_lm(prefix_len) -> Mask:
    """Every query sees the keys of the prefix (kv < prefix_len); causal after it.

    Arguments:
        prefix_len: an int, or [B] ints (one prefix length per batch row).
    """
    if isinstance(prefix_len, int) and not isinstance(prefix_len, bool):
        if prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        return _PrefixLM(prefix_len)
    t = _int_tensor(prefix_len, "prefix_len")
    if bool((t < 0).any()):
        raise ValueError(f"prefix_len must be >= 0, got {t.tolist()}")
    return _PrefixLM(tuple(t.tolist()))


class _KeyPadding(Mask):
    def __init__(self, valid_len: tuple[int, ...]):
        self.valid_len = valid_len
        self._t = torch.tensor(valid_len, dtype=torch.int64)

    def key(self):
        return ("key_padding", self.valid_len)

    def __call__(self, b, h, q, kv):
        return kv < self._t.to(kv.device)[b]

    def __repr__(self):
        return f"key_padding({list(self.valid_len)})"


def key_padding(valid_len) -> Mask:
    """Right padding: in batch row b only the keys kv < valid_len[b] are real.

    And it with ``causal()`` for a padded causal batch. Equal lengths give equal masks, so
    a new mask object per batch reuses the plan of an earlier batch with the same lengths.

    Arguments:
        valid_len: [B] ints (a list or a 1-D integer tensor), each >= 0.
    """
    t = _int_tensor(valid_len, "valid_len")
    if bool((t < 0).any()):
        raise ValueError(f"valid_len must be >= 0, got {t.tolist()}")
    return _KeyPadding(tuple(t.tolist()))


class _HeadOffset(Mask):
    def __init__(self, inner: Mask, offset: int):
        self.inner, self.offset = inner, offset

    def key(self):
        return ("head_offset", self.inner.key(), self.offset)

    def __call__(self, b, h, q, kv):
        return self.inner(b, h + self.offset, q, kv)

    def __repr__(self):
        return f"{self.inner!r} from head {self.offset}"


def _head_free(mask: Mask) -> bool:
    """Whether ``mask`` is built only of parts that never read the head (bands, documents,
    prefixes, key padding, key masks, chunks)."""
    if isinstance(mask, _Combined):
        return all(_head_free(p) for p in mask.parts)
    return mask.band is not None or isinstance(
        mask, (_Document, _PrefixLM, _KeyPadding, _KeyMask, _Chunked))


def check_length(mask: Mask, seqlen: int) -> None:
    """Refuse a mask whose parts were built for another sequence length than ``seqlen``:
    documents whose offsets do not end at S (the tokens after the last offset would belong
    to no document), a key mask of another width.

    Raises:
        ValueError: naming the part and both lengths.
    """
    if isinstance(mask, _Combined):
        for part in mask.parts:
            check_length(part, seqlen)
    elif isinstance(mask, _HeadOffset):
        check_length(mask.inner, seqlen)
    elif isinstance(mask, _Document) and mask.cu[-1] != seqlen:
        raise ValueError(
            f"mask document({list(mask.cu)}) describes a sequence of {mask.cu[-1]} tokens but "
            f"S={seqlen}: its offsets must end at S (tokens {min(mask.cu[-1], seqlen)}.."
            f"{max(mask.cu[-1], seqlen) - 1} would belong to no document)")
    elif isinstance(mask, _KeyMask) and mask._real.shape[1] != seqlen:
        raise ValueError(f"mask key_mask of [B, S]={list(mask._real.shape)} describes "
                         f"{mask._real.shape[1]} keys per row but S={seqlen}")


def head_offset(mask: Mask, offset: int) -> Mask:
    """``mask`` seen by a rank holding heads ``offset``, ``offset + 1``, ...: its local head
    h is global head h + offset (Ulysses). Masks that never read the head come back as
    they are (one plan serves every head group)."""
    return mask if offset == 0 or _head_free(mask) else _HeadOffset(mask, offset)


class _KeyMask(Mask):
    def __init__(self, real_BS: torch.Tensor):
        self._real = real_BS
        bits = np.packbits(real_BS.numpy())
        self._key = ("key_mask", tuple(real_BS.shape), bits.tobytes())
        self._on: dict = {}

    def key(self):
        return self._key

    def __call__(self, b, h, q, kv):
        dev = kv.device
        if dev not in self._on:
            self._on[dev] = self._real.to(dev)
        return self._on[dev][b, kv]

    def __repr__(self):
        return f"key_mask({list(self._real.shape)}, {int(self._real.sum())} real keys)"


def key_mask(real) -> Mask:
    """Any key padding: in batch row b, key kv is visible iff ``real[b, kv]``.

    Left padding, or holes anywhere; right padding is ``key_padding``. Masks with equal
    bits are equal (value-keyed), so batches with the same padding reuse one plan.

    Arguments:
        real: [B, S] bool (or 0/1 integer) tensor over GLOBAL positions.
    """
    if not isinstance(real, torch.Tensor) or real.dim() != 2:
        raise TypeError(f"key_mask takes a [B, S] tensor, got {type(real).__name__}")
    return _KeyMask(real.detach().to("cpu", torch.bool).contiguous())


class _Chunked(Mask):
    def __init__(self, size: int, offsets: tuple[int, ...] | None):
        self.args = (size, offsets)
        self._t = None if offsets is None else torch.tensor(offsets, dtype=torch.int64)

    def key(self):
        return ("chunked", self.args)

    def __call__(self, b, h, q, kv):
        size = self.args[0]
        off = 0 if self._t is None else self._t.to(q.device)[b]
        return torch.div(q - off, size, rounding_mode="floor") == torch.div(kv - off, size, rounding_mode="floor")

    def __repr__(self):
        return "chunked(size={}, offsets={})".format(*self.args)


def chunked(size: int, offsets=None) -> Mask:
    """Chunked attention (Llama 4's ``attention_chunk_size``): q sees kv iff both lie in
    the same chunk of ``size`` positions; and it with ``causal()``.

    Arguments:
        size: the chunk length, >= 1.
        offsets: None, or [B] ints: in batch row b chunks start at offsets[b] (mod size),
            as transformers counts them from the first real token of a left-padded row.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"chunked size must be an int >= 1, got {size!r}")
    if offsets is not None:
        offsets = tuple(_int_tensor(offsets, "offsets").tolist())
    return _Chunked(size, offsets)


class _Dilated(Mask):
    def __init__(self, segment: int, dilation: int, head_offsets: bool):
        self.args = (segment, dilation, head_offsets)

    def key(self):
        return ("dilated", self.args)

    def __call__(self, b, h, q, kv):
        segment, dilation, head_offsets = self.args
        off = (h % dilation) if head_offsets else 0
        same = torch.div(q, segment, rounding_mode="floor") == torch.div(kv, segment, rounding_mode="floor")
        return same & ((q - off) % dilation == 0) & ((kv - off) % dilation == 0)

    def __repr__(self):
        return "dilated(segment={}, dilation={}, head_offsets={})".format(*self.args)


def dilated(segment: int, dilation: int, head_offsets: bool = True) -> Mask:
    """LongNet's dilated attention: within each segment of ``segment`` positions, the
    positions p with p % dilation == offset attend to each other.

    With ``head_offsets`` head h uses offset h % dilation, so the heads together cover every
    position; without, offset 0. Queries outside the pattern see no key (out = 0,
    lse = -inf), which is what lets several dilated attentions be mixed by ``ra.merge``.
    """
    for name, x in (("segment", segment), ("dilation", dilation)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"dilated {name} must be an int >= 1, got {x!r}")
    return _Dilated(segment, dilation, bool(head_offsets))


class _Function(Mask):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, b, h, q, kv):
        return self.fn(b, h, q, kv)

    def __repr__(self):
        return f"from_function({getattr(self.fn, '__qualname__', self.fn)!r})"


def from_function(fn) -> Mask:
    """Wrap a flex_attention ``mask_mod``: ``fn(b, h, q_pos, kv_pos) -> bool tensor``.

    Positions are GLOBAL. ``fn`` must use tensor operations only (it is called on
    broadcasting index tensors, and possibly by flex under vmap) and must be pure: the ring
    caches its classification per mask object, so build a new mask if captured data
    changes, and reuse the object otherwise (a new object is classified again).
    """
    if not callable(fn):
        raise TypeError(f"from_function takes a callable mask_mod, got {type(fn).__name__}")
    return _Function(fn)


MASK_KEYS_KEPT = 1024
"""Masks ``mask_key`` remembers (the most recently keyed); older keys are forgotten."""

_REGISTRY: OrderedDict[Mask, int] = OrderedDict()
_BY_KEY: dict[int, Mask] = {}
_NEXT_KEY = [0]


@torch.compiler.assume_constant_result
def mask_key(mask: Mask | None) -> int:
    """An int standing for ``mask`` in the custom ops' plain arguments (-1 for None).

    Masks equal by value (``Mask.key``) share a key, so a compiled graph specialises on what
    a mask computes: a new mask value compiles once more, the same value does not. The
    last ``MASK_KEYS_KEPT`` masks keyed are kept; keys are never reused, so a forgotten
    key is reported (``registered_mask``), never taken for another mask.
    """
    if mask is None:
        return -1
    if mask in _REGISTRY:
        _REGISTRY.move_to_end(mask)
        return _REGISTRY[mask]
    key = _REGISTRY[mask] = _NEXT_KEY[0]
    _BY_KEY[key] = mask
    _NEXT_KEY[0] += 1
    if len(_REGISTRY) > MASK_KEYS_KEPT:
        _, old = _REGISTRY.popitem(last=False)
        del _BY_KEY[old]
    return key


def registered_mask(key: int) -> Mask:
    """The mask ``mask_key`` gave ``key`` for.

    Raises:
        ValueError: no mask has that key.
    """
    if key not in _BY_KEY:
        raise ValueError(f"no mask has key {key!r}: keys come from ringattn.masks.mask_key, "
                         f"which keeps the last {MASK_KEYS_KEPT} masks keyed")
    return _BY_KEY[key]


@torch.compiler.assume_constant_result
def and_keys(key_a: int, key_b: int) -> int:
    """The key of ``registered_mask(key_a) & registered_mask(key_b)`` (-1 stands for no
    mask). Plain ints in and out, so compiled code guards on values, not mask objects."""
    if key_a < 0 or key_b < 0:
        return max(key_a, key_b)
    return mask_key(registered_mask(key_a) & registered_mask(key_b))


@torch.compiler.assume_constant_result
def chunked_key(size: int, offsets: tuple[int, ...] | None) -> int:
    """The key of ``chunked(size, offsets)`` (plain values in, for compiled code)."""
    return mask_key(chunked(size, offsets))


def evaluate(mask: Mask, seqlen: int, q_pos: torch.Tensor, kv_pos: torch.Tensor,
             batch: int, heads: int) -> torch.Tensor:
    """Visibility of query positions ``q_pos`` [Sq] against key positions ``kv_pos`` [Sk].

    Positions >= ``seqlen`` are padding and never visible; they are clamped before the mask
    sees them, so a mask may index tensors of length S with its arguments.

    Returns:
        bool [Bm, Hm, Sq, Sk] with Bm in {1, batch} and Hm in {1, heads} (1 where the mask
        does not depend on batch or head).

    Raises:
        ValueError: the mask raised, or returned something not boolean or of the wrong shape.
    """
    dev = q_pos.device
    b = torch.arange(batch, device=dev).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, heads, 1, 1)
    q = q_pos.clamp(max=seqlen - 1).view(1, 1, -1, 1)
    kv = kv_pos.to(dev).clamp(max=seqlen - 1).view(1, 1, 1, -1)
    try:
        r = mask(b, h, q, kv)
    except Exception as exc:  # a user's mask_mod: report it as bad input, with its cause
        raise ValueError(f"mask {mask!r} failed on global position tensors: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(r, torch.Tensor) or r.dtype != torch.bool:
        what = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
        raise ValueError(f"mask {mask!r} must return a bool tensor, got {what}")
    full_shape = (batch, heads, q.shape[2], kv.shape[3])
    try:
        if torch.broadcast_shapes(r.shape, full_shape) != full_shape:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"mask {mask!r} returned shape {tuple(r.shape)}, which does not "
                         f"broadcast to [B, H, Sq, Sk] = {list(full_shape)}") from None
    r = r.reshape((1,) * (4 - r.dim()) + tuple(r.shape))
    shape = (r.shape[0], r.shape[1], q.shape[2], kv.shape[3])
    valid = (q_pos < seqlen).view(-1, 1) & (kv_pos.to(dev) < seqlen).view(1, -1)
    return r.expand(shape) & valid


_VALUES = (int, float, str, bytes, bool, type(None))


def _is_value(key) -> bool:
    if isinstance(key, tuple):
        return all(_is_value(x) for x in key)
    return isinstance(key, _VALUES)


@lru_cache(maxsize=256)
def value_digest(mask: Mask) -> int | None:
    """A 31-bit digest of what a value-keyed mask computes (its ``key``: masks built by
    ringattn from plain values, e.g. documents, chunks, key padding, and their
    combinations), the same on every rank exactly when the values are; None for a mask with
    a user function in it (``from_function``), which only its evaluations can describe."""
    key = mask.key()
    if not _is_value(key):
        return None
    return zlib.crc32(repr(key).encode()) & 0x7FFFFFFF


def fingerprint(mask: Mask, seqlen: int, batch: int, heads: int, device="cpu") -> int:
    """A 31-bit digest of the mask on a fixed probe of positions, the same on every rank
    for a mask that is the same function everywhere (the ranks compare it before any send).
    Evaluated on ``device``, where a mask's captured tensors live; cached per mask (masks
    are pure), so repeated calls cost no evaluation and no device sync."""
    return _fingerprint(mask, seqlen, batch, heads, str(device))


@lru_cache(maxsize=64)
def _fingerprint(mask: Mask, seqlen: int, batch: int, heads: int, device: str) -> int:
    n = min(seqlen, 48)
    probe = torch.unique(torch.cat([
        torch.arange(min(seqlen, 16)),
        torch.linspace(0, seqlen - 1, n).round().long(),
        torch.arange(max(0, seqlen - 16), seqlen),
    ])).to(device)
    vis = evaluate(mask, seqlen, probe, probe, batch, heads)
    data = vis.reshape(-1).to(torch.uint8).cpu().numpy().tobytes()
    return zlib.crc32(repr(tuple(vis.shape)).encode() + data) & 0x7FFFFFFF


@dataclass(eq=False)
class BlockMask:
    """Visibility of one PARTIAL block under a general mask, in the block's own rows/cols.

    The dense bool [Bm, Hm, Sq, Sk] is kept when it was computed during classification
    (``stored``), or computed again from the mask and positions on demand. ``cache`` holds
    what kernels derive from it (additive masks, flex block masks), so that too is built
    once per plan.
    """

    mask: Mask
    seqlen: int
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    batch: int
    heads: int
    stored: torch.Tensor | None = None
    tile_kinds: torch.Tensor | None = None
    """For one-block-per-step plans: uint8 [row tiles, col tiles], 0 empty, 1 full, 2 partial."""
    tile_masks: torch.Tensor | None = None
    """With ``tile_kinds``: bool [partial tiles, Bm, Hm, t, t], the partial tiles in row-major
    order (None if none, or too large to keep: then the mask is evaluated again)."""
    row_bounds: torch.Tensor | None = None
    """With ``tile_kinds``, when every row sees one run of columns: int32 [2, Bm, Hm, Sq],
    row i sees columns [row_bounds[0, .., i], row_bounds[1, .., i]) (kept instead of bits)."""
    cache: dict = field(default_factory=dict)

    def dense(self) -> torch.Tensor:
        if self.stored is not None:
            return self.stored
        return evaluate(self.mask, self.seqlen, self.q_pos, self.kv_pos, self.batch, self.heads)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
