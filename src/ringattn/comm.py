"""Communication for the ring, behind objects with explicit start() and wait().

The ring posts the next hop (send to rank+1, receive from rank-1) before it computes on the
current block, and waits only when it needs the received data. There is no barrier per hop.
Both directions of a hop go in one ``batch_isend_irecv``, so a two-rank ring (where next and
previous are the same rank) cannot deadlock on NCCL's ordering.
"""

from __future__ import annotations

import os
import time
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["HYBRID_DIMS", "PeerError", "RingComm", "LocalComm", "Hop", "agree",
           "all_gather_single", "all_to_all_single", "collective", "clear_failure", "get_timeout", "set_timeout",
           "control_group", "group_by_name", "group_from_key", "group_key", "group_members", "hybrid_mesh", "is_hybrid_mesh", "mesh_groups", "metadata_device",
           "reduce_scatter_single", "resolve_group", "set_caller_check"]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns);
# older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# likewise reduce_scatter_tensor -> reduce_scatter_single
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group,
                      what: str = "all-gather") -> None:
    """``out`` = every rank's ``x``, concatenated on dim 0 in rank order (waits at most
    ``get_timeout()``; ``what`` names it in a ``PeerError``)."""
    collective(what, group, lambda: _all_gather_single(out, x, group=group, async_op=True))


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group,
                          what: str = "reduce-scatter") -> None:
    """``out`` = this rank's chunk (dim 0, rank order) of the sum of every rank's ``x``
    (waits at most ``get_timeout()``)."""
    if "gloo" not in str(dist.get_backend(group)):
        collective(what, group, lambda: _reduce_scatter_single(out, x, group=group,
                                                               async_op=True))
        return
    # gloo runs its reduce-scatter in the calling thread (async_op or not), where no timeout
    # of ours can reach it: an all-to-all of the chunks (which gloo runs asynchronously, as
    # all-gather) and a local sum in rank order instead; the same bytes travel.
    world = dist.get_world_size(group)
    got = x.new_empty(x.numel())
    all_to_all_single(got, x.reshape(-1), [out.numel()] * world, [out.numel()] * world,
                      group, what=what)
    torch.sum(got.view(world, -1), dim=0, out=out.view(-1))


def all_to_all_single(recv: torch.Tensor, send: torch.Tensor, recv_splits, send_splits, group,
                      what: str = "all-to-all") -> None:
    """``recv`` = from each rank r its ``recv_splits[r]`` elements (rank order); ``send``'s
    ``send_splits[r]`` go to rank r (waits at most ``get_timeout()``)."""
    collective(what, group, lambda: dist.all_to_all_single(
        recv, send, recv_splits, send_splits, group=group, async_op=True))


def collective(what: str, group, post) -> None:
    """Post a collective (``post()`` returns its work handle) and wait for it at most
    ``get_timeout()`` seconds.

    Raises:
        PeerError: naming the operation (``what``, e.g. "Ulysses all-to-all of q, forward"),
            the group's ranks and the time actually waited, when posting fails or a peer
            died, stopped or never made the matching call.
    """
    _check_not_failed()
    ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    start = time.monotonic()
    try:
        work = post()
    except RuntimeError as exc:
        raise _peer_error(
            f"ringattn {what} over ranks {ranks} (this is rank {dist.get_rank()}): posting it "
            f"failed ({exc}): a peer died, or an earlier failure closed the connection") from exc
    try:
        _wait(work, start + get_timeout())
    except RuntimeError as exc:
        raise _peer_error(
            f"ringattn {what} over ranks {ranks} (this is rank {dist.get_rank()}) failed after "
            f"{_waited(start)} ({exc}): another of those ranks died, stopped, or left after an "
            f"error of its own") from exc


HYBRID_DIMS = ("ring", "ulysses")
"""mesh_dim_names of the 2-D hybrid's DeviceMesh: the ring across (nodes), Ulysses within
(the inner, faster dimension). A rank's shard index is its row-major place in the mesh,
ring_rank * U + ulysses_rank (its global rank, for a mesh over the whole world)."""


def _import_device_mesh():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch builds without distributed support have no DeviceMesh
        return None
    return DeviceMesh


_DEVICE_MESH = _import_device_mesh()


def _device_mesh_type():
    return _DEVICE_MESH


def _real(obj):
    """``obj``, or the object a FakeScriptObject stands for: torch.compile treats a
    DeviceMesh as an opaque object and hands the code it traces (an op's fake kernel, and
    the op itself through the key ``group_key`` made while tracing) such a wrapper of it.
    Code that dynamo itself traces sees the mesh as dynamo shows it, and is left alone."""
    if torch.compiler.is_dynamo_compiling():
        return obj
    try:
        from torch._library.fake_class_registry import FakeScriptObject
    except ImportError:  # torch without opaque objects never wraps a mesh
        return obj
    return obj.real_obj if isinstance(obj, FakeScriptObject) else obj


def _untraced():
    """A block whose tensor ops run for real even inside a fake kernel or a traced graph
    (making a process group, exchanging a few ints): torch's own way out of its modes."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def resolve_group(group) -> dist.ProcessGroup:
    """Accept a ProcessGroup, a 1-D DeviceMesh, the hybrid's 2-D ("ring", "ulysses")
    DeviceMesh (all of its ranks, row-major) or None (the default group)."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialized and no group was given: call "
                "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (CUDA) on "
                "every rank first (under torchrun it reads its environment), or pass group=")
        return dist.group.WORLD
    group = _real(group)
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not a member of the group it passed: "
            f"dist.new_group returns GroupMember.NON_GROUP_MEMBER on ranks outside the "
            f"group; call ringattn only on the group's own ranks")
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim == 1:
            return group.get_group()
        return mesh_groups(group)[0]
    raise TypeError(
        f"group must be a ProcessGroup, a DeviceMesh or None, got {type(group).__name__}"
    )


def is_hybrid_mesh(group) -> bool:
    """Whether ``group`` is a 2-D DeviceMesh (the hybrid's; checked by ``mesh_groups``)."""
    mesh_type = _device_mesh_type()
    return mesh_type is not None and isinstance(group, mesh_type) and group.ndim == 2


_FLAT: dict[tuple[str, str], tuple] = {}
"""(ring group, Ulysses group, group of all the mesh's ranks) of every hybrid mesh seen, by
the names of its two groups: meshes made by ``hybrid_mesh`` are entered when made, others
on first use (slicing a mesh makes a new object, so the key is its groups, not itself)."""


def mesh_groups(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
    """(all ranks row-major, the ring dimension's group, the Ulysses dimension's group) of
    the hybrid's DeviceMesh.

    The group of all ranks is the group ``hybrid_mesh`` made the mesh over, or the world
    group for a mesh of every rank; for any other mesh it is made on first use, by the
    mesh's ranks alone (which all get there, as they all attend). No group is made inside
    torch.compile's tracing of a mesh that a call has used before or that ``hybrid_mesh``
    made, and one made there is made outside the tracing.

    Raises:
        ValueError: a mesh that is not 2-D with mesh_dim_names ("ring", "ulysses"), or this
            rank is not in the mesh.
    """
    mesh = _real(mesh)
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != HYBRID_DIMS:
        raise ValueError(
            f"group must be a 1-D DeviceMesh or the hybrid's 2-D DeviceMesh with "
            f"mesh_dim_names={HYBRID_DIMS} (ring across, Ulysses within), got one with "
            f"{mesh.ndim} dims {names or None}; for one dimension of it pass mesh[dim_name]"
        )
    if mesh.get_coordinate() is None:
        with _untraced():
            members = mesh.mesh.tolist()
        raise ValueError(f"rank {dist.get_rank()} is not in the hybrid's mesh {members}: "
                         f"call it only on the mesh's ranks")
    ring, uly = mesh.get_group("ring"), mesh.get_group("ulysses")
    known = _FLAT.get((ring.group_name, uly.group_name))
    if known is None or known[0] is not ring or known[1] is not uly:
        with _untraced():
            ranks = sorted(mesh.mesh.flatten().tolist())
            if ranks == list(range(dist.get_world_size())):
                flat = dist.group.WORLD
            else:  # (torch's mesh._flatten() would need every rank of the world)
                _even_group_counts([uly, ring])
                flat = dist.new_group(ranks, backend=_backend_like(uly),
                                      use_local_synchronization=True)
        known = _FLAT[ring.group_name, uly.group_name] = (ring, uly, flat)
    return known[2], ring, uly


def group_members(pg) -> tuple[int, ...]:
    """The global ranks of ``pg`` in group-rank order: which shard each rank holds."""
    return tuple(dist.get_global_rank(pg, r) for r in range(dist.get_world_size(pg)))


def _gather_ints(group: dist.ProcessGroup, values: list[int], what: str) -> list[list[int]]:
    """Every rank's ``values`` (int64s), in group rank order (waits at most
    ``get_timeout()``)."""
    world = dist.get_world_size(group)
    row = torch.tensor(values, dtype=torch.int64, device=metadata_device(group))
    out = row.new_empty(world * row.numel())
    all_gather_single(out, row, group, what=what)
    return out.view(world, -1).tolist()


def _group_count() -> int:
    """How many process groups this process holds (torch names a group made with
    use_local_synchronization=True after its ranks and this count; it has no public
    accessor, so its registry is read here and nowhere else)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_names", ()))


def _even_group_counts(chain) -> None:
    """Bring every rank spanned by ``chain`` (groups, each gathered in turn: the Ulysses
    then the ring groups of a mesh span it) to the same ``_group_count()``, padding with
    one-rank groups: each process counts only the groups it belongs to, and members whose
    counts differ would give a locally synchronised group different names and wait for
    each other until the timeout."""
    count = _group_count()
    for group in chain:
        if dist.get_world_size(group) > 1:
            count = max(r[0] for r in _gather_ints(group, [count], "count of process groups"))
    _pad_group_count(count)


def _pad_group_count(count: int) -> None:
    while _group_count() < count:
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


def _backend_like(pg: dist.ProcessGroup):
    """The backend argument that makes new groups like ``pg``'s (None: the default's)."""
    backend = dist.get_backend(pg)
    return None if backend == dist.get_backend() else backend


def hybrid_mesh(group=None, ulysses: int = 8):
    """The hybrid's DeviceMesh over the ranks of ``group`` (None: the world): consecutive
    runs of ``ulysses`` ranks (one node's, under torchrun with that many processes per
    node) form the "ulysses" dimension, the "ring" dimension goes across them.

    Every rank of the group calls it, with the same ``ulysses``, and no other rank needs
    to: the mesh's groups are made by the group's ranks alone (``use_local_synchronization``),
    so two disjoint groups may each make their mesh, while other ranks do something else,
    and later ``dist.new_group`` calls of the whole job are not put out of step. The mesh
    is made from those groups (``DeviceMesh.from_group``), with ``group`` as the group of
    all its ranks (shard order: its group ranks).

    Raises:
        ValueError: on every rank of the group: ``ulysses`` is not a divisor of the group's
            size, or differs between its ranks. On a rank outside the group (which holds
            ``GroupMember.NON_GROUP_MEMBER`` for it): that it is not a member.
        PeerError: a rank of the group did not make the call within ``get_timeout()``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    pg = resolve_group(group)
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    ranks = [dist.get_global_rank(pg, r) for r in range(world)]
    ok = isinstance(ulysses, int) and not isinstance(ulysses, bool) and abs(ulysses) < 2**62
    given = ulysses if ok else -2**63
    count = _group_count()
    if world > 1:  # one exchange: the same ulysses everywhere, and the groups' names
        rows = _gather_ints(pg, [given, count], "hybrid_mesh's check of ulysses")
        if any(row[0] != rows[0][0] for row in rows):
            raise ValueError("hybrid_mesh: the group's ranks disagree on ulysses: " + ", ".join(
                f"rank {ranks[r]} passes {'no int' if row[0] == -2**63 else row[0]}"
                for r, row in enumerate(rows)))
        count = max(row[1] for row in rows)
    if given < 1 or world % given:
        raise ValueError(f"ulysses must be a divisor of the group's {world} ranks, got {ulysses!r}")
    _pad_group_count(count)
    r, u = divmod(me, given)
    backend = _backend_like(pg)
    # every rank makes one group of each dimension, in this order: the counts stay even
    uly = dist.new_group(ranks[r * given:(r + 1) * given], backend=backend,
                         use_local_synchronization=True)
    ring = dist.new_group(ranks[u::given], backend=backend, use_local_synchronization=True)
    device = "cuda" if "nccl" in str(dist.get_backend(pg)) else "cpu"
    mesh = DeviceMesh.from_group([ring, uly], device,
                                 torch.tensor(ranks).view(world // given, given),
                                 mesh_dim_names=HYBRID_DIMS)
    _FLAT[ring.group_name, uly.group_name] = (ring, uly, pg)
    return mesh


def group_by_name(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name`` (``ProcessGroup.group_name``).

    Custom ops take plain values only, so compiled code passes groups by name. torch has no
    public lookup by name; its functional collectives resolve names with this private
    function (torch >= 2.3), which is therefore used here and nowhere else.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


_GROUPS: dict[str, object] = {}
"""Groups and meshes handed to compiled calls, by the key ``group_key`` gave them (held, so
a key is never reused for another object)."""


@torch.compiler.assume_constant_result
def group_key(group) -> str:
    """A plain key for ``group`` (a ProcessGroup, a DeviceMesh or None), for custom ops; a
    compiled graph holds it as a constant."""
    if group is None:
        return "default"
    key = f"{type(group).__name__}:{id(group)}"
    _GROUPS[key] = group
    return key


def group_from_key(key: str):
    """The group ``group_key`` gave ``key`` (None for the default group)."""
    return None if key == "default" else _GROUPS[key]


DEFAULT_TIMEOUT_S = 300.0
"""How long ringattn waits for a peer (a hop, the agreement) before it raises
``PeerError`` naming it: well under torch's 30-minute process-group default, so a dead or
frozen rank is named within minutes. ``set_timeout`` or the environment variable
``RINGATTN_TIMEOUT_S`` changes it."""

_TIMEOUT = [float(os.environ.get("RINGATTN_TIMEOUT_S", DEFAULT_TIMEOUT_S))]


def set_timeout(seconds: float) -> None:
    """Wait at most ``seconds`` for a peer in any ringattn communication (every rank should
    set the same value).

    Raises:
        ValueError: not a positive number.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"the timeout must be a number of seconds > 0, got {seconds!r}")
    _TIMEOUT[0] = float(seconds)


def get_timeout() -> float:
    return _TIMEOUT[0]


class PeerError(RuntimeError):
    """A peer rank died, stopped, or never made the matching call: raised where ringattn
    waited for it, naming the peer, the operation and the ring step, with the transport's
    exception as the cause. The process group cannot be used afterwards (tear it down):
    messages of the failed call may still be in flight, so every later ringattn call in
    this process raises a PeerError at once (``clear_failure`` after making new groups)."""


_FAILED: list[str] = []
"""The first PeerError of this process: later calls refuse to run on stale messages."""


def _peer_error(message: str) -> PeerError:
    """A PeerError, remembered so that the next ringattn call fails at once."""
    if not _FAILED:
        _FAILED.append(message)
    return PeerError(message)


def clear_failure() -> None:
    """Forget an earlier ``PeerError`` (call it after destroying the failed process groups
    and making new ones on every rank)."""
    _FAILED.clear()


def _check_not_failed() -> None:
    if _FAILED:
        raise PeerError(
            f"an earlier ringattn call in this process failed ({_FAILED[0]}); messages of that "
            f"call may still be in flight, so its process groups are out of step: destroy "
            f"them (dist.destroy_process_group), make new ones on every rank and call "
            f"ringattn.comm.clear_failure(), or restart the job")


def _waited(start: float) -> str:
    """How long this rank waited since ``start``, with the timeout it waited under."""
    took = time.monotonic() - start
    if took >= get_timeout() * 0.99:
        return f"waiting the full timeout of {get_timeout():g} s"
    return f"{took:.2f} s (the transport reported the failure; the timeout is {get_timeout():g} s)"


def _wait(req, deadline: float) -> None:
    """``req.wait`` until ``deadline`` (time.monotonic()); transport errors propagate."""
    left = max(deadline - time.monotonic(), 0.001)
    if req.wait(timedelta(seconds=left)) is False:  # backends that report instead of raising
        raise RuntimeError(f"timed out after {left:.1f} s")


class Hop:
    """One ring hop: send ``send`` ``shift`` ranks on, receive ``recv`` from ``shift`` back.
    ``what`` (e.g. "forward step 2") names it in a ``PeerError``."""

    def __init__(self, comm: "RingComm", send: torch.Tensor, recv: torch.Tensor, tag: int,
                 shift: int = 1, what: str = "ring hop"):
        self._peers = (comm.global_rank(comm.rank + shift), comm.global_rank(comm.rank - shift))
        self._ops = [
            dist.P2POp(dist.isend, send, self._peers[0], comm.group, tag),
            dist.P2POp(dist.irecv, recv, self._peers[1], comm.group, tag),
        ]
        self._reqs = None
        self.recv = recv
        self.what = what

    def start(self) -> "Hop":
        """Post both directions.

        Raises:
            PeerError: the transport refused to post them (a connection to a peer is gone).
        """
        try:
            self._reqs = dist.batch_isend_irecv(self._ops)
        except RuntimeError as exc:
            raise _peer_error(
                f"ringattn {self.what}: posting the send to rank {self._peers[0]} and the "
                f"receive from rank {self._peers[1]} failed ({exc}): one of them died, or an "
                f"earlier failure closed the connection") from exc
        return self

    def wait(self) -> torch.Tensor:
        """Wait for both directions; return the received tensor and let go of the sent one.

        Raises:
            PeerError: the send to the next rank or the receive from the previous one failed
                (a peer died) or did not complete within ``get_timeout()`` seconds.
        """
        start = time.monotonic()
        deadline = start + get_timeout()
        for req, peer, verb in zip(self._reqs, self._peers, ("sending to", "receiving from")):
            try:
                _wait(req, deadline)
            except RuntimeError as exc:
                raise _peer_error(
                    f"ringattn {self.what}: {verb} rank {peer} failed after {_waited(start)} "
                    f"({exc}): rank {peer} died, stopped, or left the ring after an error of "
                    f"its own") from exc
        recv, self.recv, self._ops, self._reqs = self.recv, None, None, None
        return recv


class RingComm:
    """The ring of one process group: this rank, its neighbours, and hops between them."""

    # Tags keep the K/V stream and the dK/dV stream apart when both are in flight.
    KV_TAG = 0
    GRAD_TAG = 1

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) for r in range(self.world)]

    def global_rank(self, rank: int) -> int:
        """Global rank of group rank ``rank`` (taken mod W)."""
        return self._global[rank % self.world]

    def hop(self, send: torch.Tensor, recv: torch.Tensor, tag: int, shift: int = 1,
            what: str = "ring hop") -> Hop:
        """Post one hop now (to rank + shift, from rank - shift); ``wait()`` before reading
        ``recv``. ``what`` names the hop in errors (e.g. "forward step 2")."""
        return Hop(self, send, recv, tag, shift, what).start()


class LocalComm:
    """A ring of one rank (strategies that attend locally after their own collectives):
    it never hops."""

    group = None
    rank = 0
    world = 1

    def hop(self, *args, **kwargs):
        raise RuntimeError("a one-rank ring never hops")


_batch_isend_irecv = dist.batch_isend_irecv  # the agreement's own reference (see testing)

AGREE_TAG = 7
"""Tag of the agreement's messages (the ring's hops use 0 and 1)."""


def _exchange(group: dist.ProcessGroup, row: torch.Tensor) -> torch.Tensor:
    """Every rank's ``row`` [W, n] (an all-gather by point-to-point messages, so that the
    ranks that never answer within ``get_timeout()`` can be named).

    Raises:
        PeerError: naming the ranks that died or did not arrive.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    table = row.new_empty(world, row.numel())
    table[me] = row
    peers = [r for r in range(world) if r != me]
    ops = [dist.P2POp(dist.isend, row, dist.get_global_rank(group, r), group, AGREE_TAG)
           for r in peers]
    ops += [dist.P2POp(dist.irecv, table[r], dist.get_global_rank(group, r), group, AGREE_TAG)
            for r in peers]
    try:
        reqs = _batch_isend_irecv(ops)
    except RuntimeError as exc:
        raise _peer_error(
            f"ringattn's agreement before the ring (this is rank {dist.get_rank()}): posting "
            f"its messages to the other ranks failed ({exc}): a peer died, or an earlier "
            f"failure closed the connection") from exc
    start = time.monotonic()
    deadline = start + get_timeout()
    missing, first, waited = [], None, None
    for r, req in zip(peers, reqs[len(peers):]):
        try:
            _wait(req, deadline)
        except RuntimeError as exc:
            missing.append(dist.get_global_rank(group, r))
            first = first or exc
            waited = waited or _waited(start)
            deadline = time.monotonic()  # the rest: only what has already arrived
    if missing:
        raise _peer_error(
            f"ringattn's agreement before the ring (this is rank {dist.get_rank()}): rank(s) "
            f"{missing} of the group did not answer (this rank gave up after {waited}): they "
            f"died, stopped, or are not making this ringattn call") from first
    for req in reqs[:len(peers)]:
        try:
            _wait(req, time.monotonic() + get_timeout())
        except RuntimeError as exc:
            raise _peer_error(f"ringattn's agreement: a send failed after every peer "
                              f"answered ({exc}): the receiving rank died") from exc
    return table


def _by_value(per_rank: dict) -> list:
    """[(value, [ranks with it])] in order of first appearance: identical messages once."""
    groups: dict = {}
    for r, v in per_rank.items():
        groups.setdefault(v, []).append(r)
    return list(groups.items())


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


_CONTROL: dict = {}


def control_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group with ``group``'s ranks that carries CPU tensors: ``group`` itself when its
    backend has gloo, else a gloo group made once per group (every member's first
    agreement makes it). The agreement's small all-gather runs there, so reading its
    result back never waits for a GPU (no device synchronisation per attention call)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return group
    key = group.group_name
    if key not in _CONTROL:
        ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        _CONTROL[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _CONTROL[key]


def metadata_device(group: dist.ProcessGroup) -> torch.device:
    """Where small control tensors of this group live (the GPU for NCCL, else the CPU)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_CHECK_CALLER = [os.environ.get("RINGATTN_CHECK_CALLER", "1") != "0"]
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def set_caller_check(enabled: bool) -> None:
    """Whether the agreement also compares where each rank called ringattn from (the file
    name, line and function of the first frame outside ringattn): on by default, so that a
    rank's extra call from another line is refused instead of pairing with the others'
    next call. Programs whose ranks call from different lines on purpose turn it off on
    every rank (or set ``RINGATTN_CHECK_CALLER=0``).

    Raises:
        TypeError: not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_caller_check takes a bool, got {enabled!r}")
    _CHECK_CALLER[0] = enabled


def caller_site() -> str:
    """``file.py:line (function)`` of the first frame outside the ringattn package (the
    file's base name: paths may differ between nodes), or "" when the check is off."""
    if not _CHECK_CALLER[0]:
        return ""
    for frame, line in traceback.walk_stack(None):
        name = frame.f_code.co_filename
        if not name.startswith(_PACKAGE):
            return f"{os.path.basename(name)}:{line} ({frame.f_code.co_name})"
    return "?"


def site_digest(site: str) -> int:
    """The int the agreement compares for a ``caller_site()`` (0: the check is off)."""
    return zlib.crc32(site.encode()) & 0x7FFFFFFF if site else 0


_CALLS: dict[str, int] = {}
"""Agreements this process has made per (control) group: every call's sequence number."""


ROW_INTS = 64
"""Every agreement exchanges rows of this many int64s, whatever call it is for (an
attention call's row and ``shard``'s differ in their fields, not in their size), so that
ranks in different kinds of call meet, compare and raise instead of mismatching messages."""


def agree(
    group: dist.ProcessGroup,
    fields: dict[str, int],
    error: Exception | None,
    describe=lambda name, value: str(value),
    reduce: tuple[str, ...] = (),
    chained: tuple[tuple[str, str, str], ...] = (),
    what: str = "an attention call",
    per_rank: tuple[str, ...] = (),
) -> dict:
    """Raise the same exception on every rank if any rank failed or the ranks disagree.

    One exchange of a small int64 CPU vector (an error flag, the call's sequence number on
    this group, which kind of call it is, and the ``fields``; ``ROW_INTS`` long for every
    kind of call) with every other rank (point-to-point on the group's ``control_group``: no
    GPU is waited for, and a rank that never answers within ``get_timeout()`` is named in a
    ``PeerError``), made before the first ring send, so bad or inconsistent input never
    leaves a rank waiting for a peer that has already given up. A rank that failed its local
    checks passes -1 for what it could not compute. Only when some rank failed, or ranks
    make different kinds of call (``what`` names this rank's, e.g. "shard"), is a second
    exchange made, of the messages, so all ranks can name them.

    Fields named in ``reduce`` may differ between ranks; their maximum over the ranks is
    returned. Fields named in ``per_rank`` may differ too; their list over the ranks (in
    group rank order) is returned. Each ``(own, next, what)`` in ``chained`` names two
    fields that differ between ranks too: rank r's ``own`` must equal rank r - 1's ``next``
    (what rank r - 1 computed about rank r), for every r; ``what`` says what differs.

    Returns:
        {name: max over ranks} for ``reduce`` and {name: [value of each rank]} for
        ``per_rank``: the same dict on every rank.

    Raises:
        ValueError or TypeError: the class of the lowest failing rank's error, with every
            failing rank's message; ValueError naming the field where ranks disagree, the
            ranks whose calls are out of step (their sequence numbers differ) or that make
            different kinds of call.
        PeerError: a rank did not answer, or an earlier call in this process failed.
    """
    _check_not_failed()
    world = dist.get_world_size(group)
    if world == 1:
        if error is not None:
            raise error
        return {**{name: int(fields[name]) for name in reduce},
                **{name: [int(fields[name])] for name in per_rank}}
    names = list(fields)
    if len(names) + 3 > ROW_INTS:
        raise RuntimeError(f"an agreement of {len(names)} fields does not fit ROW_INTS={ROW_INTS}")
    flag = 0 if error is None else (2 if isinstance(error, TypeError) else 1)
    kind = zlib.crc32(",".join([what, *names]).encode()) & 0x7FFFFFFF  # which call this is
    group = control_group(group)  # CPU tensors: no device sync to read the table
    seq = _CALLS[group.group_name] = _CALLS.get(group.group_name, 0) + 1
    values = [flag, seq, kind, *(int(fields[n]) for n in names)]
    row = torch.tensor(values + [0] * (ROW_INTS - len(values)), dtype=torch.int64)
    table = _exchange(group, row).tolist()  # [W][ROW_INTS]: plain ints from here on
    if any(r[1] != seq for r in table):
        at = _by_value({r: table[r][1] for r in range(world)})
        raise ValueError(
            "ringattn calls out of step on this group: "
            + ", ".join(f"{_ranks(rs)} {'are' if len(rs) > 1 else 'is'} at call {n}" for n, rs in at)
            + ": every rank must make the same ringattn calls on a group in the same order (a "
              "rank made an extra call or skipped one, or an earlier failure left it behind)")
    if any(r[2] != kind for r in table):
        calls: list = [None] * world
        dist.all_gather_object(calls, what, group=group)
        said = _by_value(dict(enumerate(calls)))
        raise ValueError(
            "ringattn calls out of step on this group: "
            + ", ".join(f"{_ranks(rs)} {'are' if len(rs) > 1 else 'is'} in {c}" for c, rs in said)
            + f" (call {seq} on this group): every rank must make the same ringattn calls in "
              f"the same order (a rank made an extra call or skipped one)")
    flags = [r[0] for r in table]
    table = [r[3:3 + len(names)] for r in table]
    if any(flags):
        messages: list = [None] * world
        dist.all_gather_object(messages, None if error is None else str(error), group=group)
        failed = [r for r in range(world) if flags[r] != 0]
        cls = TypeError if flags[failed[0]] == 2 else ValueError
        said = _by_value({r: messages[r] for r in failed})
        # this rank's own exception (with the user's traceback, e.g. a mask that raised)
        # is the cause; other ranks have only the message
        raise cls("; ".join(f"{_ranks(rs)}: {msg}" for msg, rs in said)) from error
    column = {name: [r[i] for r in table] for i, name in enumerate(names)}
    differs = set(reduce) | set(per_rank) | {name for pair in chained for name in pair[:2]}
    if any(r != table[0] for r in table):  # then find the fields that differ
        for name in names:
            col = column[name]
            if name not in differs and any(x != col[0] for x in col):
                has = _by_value({r: describe(name, col[r]) for r in range(world)})
                values = ", ".join(f"{_ranks(rs)} {'have' if len(rs) > 1 else 'has'} {v}"
                                   for v, rs in has)
                raise ValueError(f"ranks disagree on {name}: {values}")
    for own, nxt, said in chained:
        pairs = [(r - 1) % world for r in range(world)
                 if column[own][r] != column[nxt][(r - 1) % world]]
        if pairs:
            raise ValueError("; ".join(f"rank {p} and rank {(p + 1) % world} disagree on {said} "
                                       f"of rank {(p + 1) % world}" for p in pairs))
    return {**{name: max(column[name]) for name in reduce},
            **{name: column[name] for name in per_rank}}


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
