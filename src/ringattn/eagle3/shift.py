"""Per-token values a few positions ahead, across shard boundaries (Eagle3's step shifts).

Legend: B batch, L local seq, S global seq, W world size, R rows received.

Eagle3's step j at index i reads the input token and the teacher of position i + 1 + j. With
packed documents (``cu_seqlens``) a document's end is an end of the sequence: no row is read
across it. On
a shard the last positions of every segment (zigzag chunk, contiguous block, or every token
of a striped shard) need rows that live on other ranks. ``Lookahead`` works out once which
rows those are, receives them in one ``all_to_all`` per tensor (each rank gets exactly the
rows it lacks: about ``width`` per segment, independent of S), and then serves any shift
0 <= k <= width as a local gather, so no chain of tokens loses one at a shard boundary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import all_to_all_single, metadata_device, resolve_group
from ..layouts import get_layout, local_positions
from ..masks import check_cu_seqlens

__all__ = ["Lookahead"]


def _owners(layout, world: int, padded: int, pos: torch.Tensor) -> torch.Tensor:
    """The rank holding each global position in ``pos`` (all < S)."""
    owner = torch.full_like(pos, -1)
    for r in range(world):
        for seg in layout.segments(r, world, padded):
            off = pos - seg.global_start
            hit = (off >= 0) & (off % seg.stride == 0) & (off // seg.stride < seg.length)
            owner[hit] = r
    return owner


class Lookahead:
    """Rows at global positions p + k for this rank's positions p, 0 <= k <= ``width``.

    Arguments:
        group: the context-parallel group, or None for one process holding everything.
        layout, seqlen: how the sequence was sharded (as for ``ringattn.shard``).
        width: the largest shift that will be asked for.
        cu_seqlens: packed documents (flash-attn's offsets; the shards' layout is then
            per-document); a shift never leaves its document (``fill`` instead).

    ``extend(x, fill)`` receives the rows of a [B, L, ...] tensor that this rank lacks (one
    all_to_all); ``take(ext, k)`` then returns [B, L, ...] whose slot for position p holds
    x's row for p + k (``fill`` past the end of the sequence and on padding slots).
    """

    def __init__(self, *, group, layout: str, seqlen: int, width: int, cu_seqlens=None):
        if not isinstance(width, int) or width < 0:
            raise ValueError(f"width must be an int >= 0, got {width!r}")
        self.group = None if group is None else resolve_group(group)
        world = 1 if self.group is None else dist.get_world_size(self.group)
        rank = 0 if self.group is None else dist.get_rank(self.group)
        cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seqlen)
        lay = get_layout(layout, cu)
        # the end of each position's document (S without documents): shifts stop there
        bounds = torch.tensor(cu if cu is not None else (0, seqlen))
        self.world, self.width = world, width
        pos = local_positions(lay, rank, world, seqlen)  # increasing, padding slots >= S
        self.local_len = pos.numel()
        real = pos[pos < seqlen]
        end = bounds[torch.bucketize(pos.clamp(max=seqlen - 1), bounds, right=True)]
        end = torch.where(pos < seqlen, end, seqlen)  # [L] end of each slot's document
        ahead = (real[:, None] + torch.arange(1, width + 1))
        ahead = torch.unique(ahead[ahead < end[pos < seqlen][:, None]])
        need = ahead[~torch.isin(ahead, pos)]
        owner = _owners(lay, world, lay.padded_len(seqlen, world), need)
        order = torch.argsort(owner, stable=True)
        need, owner = need[order], owner[order]
        self.recv_splits = torch.bincount(owner, minlength=world).tolist()
        if world > 1:  # (on the group's device: CPU for gloo, the GPU for NCCL)
            dev = metadata_device(self.group)
            counts = torch.tensor(self.recv_splits, dtype=torch.int64, device=dev)
            theirs = torch.empty_like(counts)
            all_to_all_single(theirs, counts, [1] * world, [1] * world, self.group,
                              what="Eagle3 lookahead's row counts")
            self.send_splits = theirs.tolist()
            asked = torch.empty(sum(self.send_splits), dtype=torch.int64, device=dev)
            all_to_all_single(asked, need.to(dev), self.send_splits, self.recv_splits,
                              self.group, what="Eagle3 lookahead's row requests")
            self.send_slots = torch.searchsorted(pos, asked.cpu())
        else:
            self.send_splits, self.send_slots = [0], torch.zeros(0, dtype=torch.int64)
        # for every shift k: each local slot's source, as a local slot, a received row or fill
        keys = torch.cat([pos, need])
        sorted_keys, idx = torch.sort(keys)
        n_local = pos.numel()
        self._local, self._remote, self._fill = [], [], []
        for k in range(width + 1):
            q = pos + k
            at = torch.searchsorted(sorted_keys, q).clamp(max=keys.numel() - 1)
            src = idx[at]
            found = (pos < seqlen) & (q < end) & (sorted_keys[at] == q)
            remote = found & (src >= n_local)
            self._local.append(torch.where(found & ~remote, src, 0))
            self._remote.append((torch.nonzero(remote).flatten(), src[remote] - n_local))
            self._fill.append(torch.nonzero(~found).flatten())
        self.received = need.numel()

    def extend(self, x: torch.Tensor, fill=0):
        """What ``take`` reads for a [B, L, ...] tensor: (x itself, the R rows received from
        other ranks, the fill value). One all_to_all; no copy of x."""
        if x.dim() < 2 or x.shape[1] != self.local_len:
            raise ValueError(f"expected [B, L={self.local_len}, ...], got {tuple(x.shape)}")
        rows = x.transpose(0, 1)  # [L, B, ...]: all_to_all splits dim 0
        got = rows.new_empty((self.received, *rows.shape[1:]))
        if self.world > 1:
            all_to_all_single(got, rows[self.send_slots.to(x.device)].contiguous(),
                              self.recv_splits, self.send_splits, self.group,
                              what="Eagle3 lookahead's rows")
        return x, got.transpose(0, 1), fill

    def take(self, ext, k: int) -> torch.Tensor:
        """[B, L, ...]: the row of position p + k for every local position p (``fill`` past
        the end of the sequence and on padding slots)."""
        if not 0 <= k <= self.width:
            raise ValueError(f"shift {k} is outside [0, width={self.width}]")
        x, got, fill = ext
        dev = x.device
        out = x.index_select(1, self._local[k].to(dev))
        slots, rows = self._remote[k]
        if slots.numel():
            out[:, slots.to(dev)] = got[:, rows.to(dev)]
        if self._fill[k].numel():
            out[:, self._fill[k].to(dev)] = fill
        return out


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
