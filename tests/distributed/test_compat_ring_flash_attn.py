"""ring-flash-attn's call sites with one import changed (``ringattn.compat.ring_flash_attn``)
and flash-attn's varlen call (``ra.varlen_attention``): each run as ring-flash-attn's own
tests write it (the whole tensors made on every rank, its local split, the call, a backward
with the local dout), exact against the float64 oracle on every rank for out, lse and the
gradients, S not divisible by 2W included (shards from ``ra.shard`` and ``seqlen``)."""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.compat import ring_flash_attn as rfa
from reference import attention, rel_err

TOL = 1e-5  # float32 against float64 (README's contract)


# -- ring-flash-attn's local splits, as its tests write them ---------------------------------

def zigzag_local(value, rank, world, dim=1):
    chunks = value.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - rank - 1]], dim=dim).contiguous()


def stripe_local(value, rank, world, dim=1):
    value = torch.stack(value.split(world, dim=dim), dim=dim).transpose(dim, dim + 1)
    index = [rank if i == dim else slice(None) for i in range(value.dim())]
    return value[tuple(index)].contiguous()


def ring_local(value, rank, world, dim=1):
    return value.chunk(world, dim=dim)[rank].contiguous()


def doc_local(value, cu, rank, world, zigzag):
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        if zigzag:
            chunks = value[a:b].chunk(2 * world, dim=0)
            parts += [chunks[rank], chunks[2 * world - 1 - rank]]
        else:
            parts.append(value[a:b].chunk(world, dim=0)[rank])
    return torch.cat(parts, dim=0).contiguous()


def _docs_ok(cu, causal):
    s = cu[-1]
    doc = torch.zeros(s, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = i
    ok = doc[:, None] == doc[None, :]
    if causal:
        ok &= torch.arange(s)[None, :] <= torch.arange(s)[:, None]
    return ok


def _ok(s, causal):
    i = torch.arange(s)
    return (i[None, :] <= i[:, None]) if causal else torch.ones(s, s, dtype=torch.bool)


def _ref(q, k, v, do, ok, **kw):
    """float64 out [.., S, H, D], lse [.., H, S] and grads of q, k, v (batched [B, S, ...])."""
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = attention(qd, kd, vd, ok, **kw)
    (out * do.double()).sum().backward()
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


def _data(b, s, h, hkv, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, h, d, generator=g), torch.randn(b, s, hkv, d, generator=g),
            torch.randn(b, s, hkv, d, generator=g), torch.randn(b, s, h, d, generator=g))


def batch_cases():
    """Rank side: the batch functions of every layout, plain/kvpacked/qkvpacked."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    s = 4 * world * 3
    splits = {"ring": ring_local, "zigzag": zigzag_local, "stripe": stripe_local}
    names = {"ring": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn",
             "stripe": "stripe_flash_attn"}
    for kind, split in splits.items():
        for causal in (True, False):
            for pack in ("", "kvpacked", "qkvpacked"):
                hkv = 4 if pack == "qkvpacked" else 2
                q, k, v, do = _data(2, s, 4, hkv)
                ro, rl, dq, dk, dv = _ref(q, k, v, do, _ok(s, causal))
                local = [split(t, rank, world).requires_grad_() for t in (q, k, v)]
                name = names[kind] + ("_" + pack if pack else "") + "_func"
                fn = getattr(rfa, name)
                if pack == "qkvpacked":
                    qkv = torch.stack([t.detach() for t in local], dim=2).requires_grad_()
                    out, lse, none = fn(qkv, causal=causal, return_attn_probs=True)
                elif pack == "kvpacked":
                    kv = torch.stack([t.detach() for t in local[1:]], dim=2).requires_grad_()
                    out, lse, none = fn(local[0], kv, causal=causal, return_attn_probs=True)
                else:
                    out, lse, none = fn(*local, causal=causal, return_attn_probs=True)
                (out * split(do, rank, world)).sum().backward()
                if pack == "qkvpacked":
                    got = qkv.grad.unbind(2)
                elif pack == "kvpacked":
                    got = (local[0].grad, *kv.grad.unbind(2))
                else:
                    got = tuple(t.grad for t in local)
                errs = {"out": rel_err(out, split(ro, rank, world)),
                        "lse": rel_err(lse, split(rl, rank, world, dim=2), floor=1.0)}
                for n, g, r in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
                    errs[n] = rel_err(g, split(r, rank, world))
                results.append((name, causal, none, errs))
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_batch_functions_exact(clusters, world):
    for rank, results in enumerate(clusters(world).run(batch_cases, timeout=200)):
        assert len(results) == 18
        for name, causal, none, errs in results:
            assert none is None
            assert max(errs.values()) <= TOL, (rank, name, causal, errs)


def any_length_cases():
    """Rank side: S not divisible by 2W, through ra.shard and the extra seqlen keyword."""
    results = []
    for s in (13, 2 * dist.get_world_size() * 3 + 1):
        for layout, fn in (("zigzag", rfa.zigzag_ring_flash_attn_func),
                           ("contiguous", rfa.ring_flash_attn_func),
                           ("striped", rfa.stripe_flash_attn_func)):
            q, k, v, do = _data(1, s, 4, 1)
            ro, rl, dq, dk, dv = _ref(q, k, v, do, _ok(s, True))
            local = [ra.shard(t, layout=layout, seqlen=s).requires_grad_() for t in (q, k, v)]
            out = fn(*local, causal=True, seqlen=s)
            (out * ra.shard(do, layout=layout, seqlen=s)).sum().backward()
            errs = {n: rel_err(t, ra.shard(r, layout=layout, seqlen=s))
                    for n, t, r in (("out", out, ro), ("dq", local[0].grad, dq),
                                    ("dk", local[1].grad, dk), ("dv", local[2].grad, dv))}
            results.append((s, layout, errs))
    return results


@pytest.mark.timeout(180)
def test_any_length(clusters):
    for rank, results in enumerate(clusters(3).run(any_length_cases, timeout=150)):
        for s, layout, errs in results:
            assert max(errs.values()) <= TOL, (rank, s, layout, errs)


def varlen_cases():
    """Rank side: ring and zigzag varlen (local cu_seqlens, their split), packed forms."""
    rank, world = dist.get_rank(), dist.get_world_size()
    unit = 2 * world
    cu = [0, 3 * unit, 4 * unit, 8 * unit]
    local_cu = torch.tensor(cu, dtype=torch.int32) // world
    local_max = int((local_cu[1:] - local_cu[:-1]).max())
    results = []
    for zigzag, base in ((False, "ring_flash_attn_varlen"), (True, "zigzag_ring_flash_attn_varlen")):
        for causal in (True, False):
            for pack in ("", "kvpacked", "qkvpacked"):
                hkv = 4 if pack == "qkvpacked" else 2
                q, k, v, do = (t[0] for t in _data(1, cu[-1], 4, hkv, seed=3))
                ro, rl, dq, dk, dv = (t[0] for t in _ref(q[None], k[None], v[None], do[None],
                                                          _docs_ok(cu, causal)))
                split = lambda t: doc_local(t, cu, rank, world, zigzag)  # noqa: E731
                local = [split(t).requires_grad_() for t in (q, k, v)]
                fn = getattr(rfa, base + ("_" + pack if pack else "") + "_func")
                if pack == "qkvpacked":
                    packed = torch.stack([t.detach() for t in local], dim=1).requires_grad_()
                    out, lse, _ = fn(packed, local_cu, local_max, causal=causal,
                                     return_attn_probs=True)
                elif pack == "kvpacked":
                    packed = torch.stack([t.detach() for t in local[1:]], dim=1).requires_grad_()
                    out, lse, _ = fn(local[0], packed, local_cu, local_max, causal=causal,
                                     return_attn_probs=True)
                else:
                    out, lse, _ = fn(*local, local_cu, local_max, causal=causal,
                                     return_attn_probs=True)
                (out * split(do)).sum().backward()
                got = {"": lambda: [t.grad for t in local],
                       "kvpacked": lambda: [local[0].grad, *packed.grad.unbind(1)],
                       "qkvpacked": lambda: list(packed.grad.unbind(1))}[pack]()
                errs = {"out": rel_err(out, split(ro)),
                        "lse": rel_err(lse, split(rl.transpose(0, 1)).transpose(0, 1), floor=1.0)}
                for n, g, r in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
                    errs[n] = rel_err(g, split(r))
                results.append((base, pack, causal, errs))
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_varlen_functions_exact(clusters, world):
    for rank, results in enumerate(clusters(world).run(varlen_cases, timeout=200)):
        assert len(results) == 12
        for base, pack, causal, errs in results:
            assert max(errs.values()) <= TOL, (rank, base, pack, causal, errs)


def llama3_cases():
    """Rank side: llama3_flash_attn_prepare_cu_seqlens and the llama3 varlen functions, as
    ring-flash-attn's test runs them (every rank a contiguous slice of the packed tokens),
    with prepare's tensor, a copy of it on one rank only, and copies on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cu = [0, 5, 7, 20, 24 * world]
    total, per = cu[-1], cu[-1] // world
    results = []
    for causal in (True, False):
        prepared = rfa.llama3_flash_attn_prepare_cu_seqlens(
            torch.tensor(cu, dtype=torch.int32), causal=causal, rank=rank, world_size=world)
        cu_q, cu_k, max_q, max_k, k_slice = prepared
        # what the values mean: query document j of this slice attends to key document j of
        # local_k_slice (causal: from the document's start up to the query slice's end)
        lo, hi = rank * per, (rank + 1) * per
        meaning = []
        for j in range(len(cu_q) - 1):
            q_a, q_b = lo + int(cu_q[j]), lo + int(cu_q[j + 1])
            k_a, k_b = k_slice.start + int(cu_k[j]), k_slice.start + int(cu_k[j + 1])
            start = max(c for c in cu if c <= q_a)
            end = q_b if causal else min(c for c in cu if c >= q_b)
            meaning.append((k_a, k_b) == (start, end))
        meaning.append(max_q == int((cu_q[1:] - cu_q[:-1]).max()))
        meaning.append(max_k == int((cu_k[1:] - cu_k[:-1]).max()))
        # the tensor prepare returned, a copy on rank 0 only (equal in value), a copy on
        # every rank: every rank takes the same path whatever the tensor carries
        for pack, stride, copied in (("qkvpacked", 1, False), ("", 2, rank == 0),
                                     ("kvpacked", 1, True)):
            hkv = 4 if pack == "qkvpacked" else 2
            q, k, v, do = (t[0] for t in _data(1, total, 4, hkv, seed=5))
            ro, rl, dq, dk, dv = (t[0] for t in _ref(q[None], k[None], v[None], do[None],
                                                      _docs_ok(cu, causal)))
            split = lambda t: t[lo:hi].contiguous()  # noqa: E731
            local = [split(t).requires_grad_() for t in (q, k, v)]
            cq = cu_q.clone() if copied else cu_q
            args = (cq, cu_k, max_q, max_k, stride, k_slice)
            if pack == "qkvpacked":
                packed = torch.stack([t.detach() for t in local], dim=1).requires_grad_()
                out, lse, _ = rfa.llama3_flash_attn_varlen_qkvpacked_func(
                    packed, *args, causal=causal, return_attn_probs=True)
                got = lambda: list(packed.grad.unbind(1))  # noqa: E731
            elif pack == "kvpacked":
                packed = torch.stack([t.detach() for t in local[1:]], dim=1).requires_grad_()
                out, lse, _ = rfa.llama3_flash_attn_varlen_kvpacked_func(
                    local[0], packed, *args, causal=causal, return_attn_probs=True)
                got = lambda: [local[0].grad, *packed.grad.unbind(1)]  # noqa: E731
            else:
                out, lse, _ = rfa.llama3_flash_attn_varlen_func(
                    *local, *args, causal=causal, return_attn_probs=True)
                got = lambda: [t.grad for t in local]  # noqa: E731
            (out * split(do)).sum().backward()
            errs = {"out": rel_err(out, split(ro)),
                    "lse": rel_err(lse, rl[:, lo:hi], floor=1.0)}
            for n, g, r in zip(("dq", "dk", "dv"), got(), (dq, dk, dv)):
                errs[n] = rel_err(g, split(r))
            results.append((causal, pack, meaning, errs))
    return results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_llama3_exact(clusters, world):
    for rank, results in enumerate(clusters(world).run(llama3_cases, timeout=120)):
        for causal, pack, meaning, errs in results:
            assert all(meaning), (rank, causal, meaning)
            assert max(errs.values()) <= TOL, (rank, causal, pack, errs)


def varlen_attention_cases():
    """Rank side: ra.varlen_attention on ra.shard(..., dim=0, cu_seqlens) shards, every
    strategy and layout, documents of any length, GQA, a window; and its refusals."""
    s = 29
    cu = [0, 1, 9, 10, 29]
    results = []
    q, k, v, do = (t[0] for t in _data(1, s, 4, 2, seed=7))
    for strategy in ("ring", "ulysses", "allgather", "auto"):
        for layout in ("zigzag", "contiguous", "doc_contiguous", "striped"):
            for window in ((-1, -1), (3, 0)):
                ok = _docs_ok(cu, True)
                if window[0] >= 0:
                    i = torch.arange(s)
                    ok &= i[None, :] >= i[:, None] - window[0]
                ro, rl, dq, dk, dv = (t[0] for t in _ref(q[None], k[None], v[None], do[None], ok))
                sh = lambda t: ra.shard(t, dim=0, cu_seqlens=cu, layout=layout)  # noqa: E731
                local = [sh(t).requires_grad_() for t in (q, k, v)]
                out, lse = ra.varlen_attention(*local, torch.tensor(cu, dtype=torch.int32),
                                               torch.tensor(cu, dtype=torch.int32), 19, 19,
                                               causal=True, window_size=window, layout=layout,
                                               strategy=strategy, return_lse=True)
                (out * sh(do)).sum().backward()
                real = ra.positions(s, cu_seqlens=cu, layout=layout)[0] < s
                errs = {"out": rel_err(out, sh(ro)),
                        "lse": rel_err(lse[:, real], sh(rl.transpose(0, 1)).transpose(0, 1)[:, real],
                                       floor=1.0),
                        "dq": rel_err(local[0].grad, sh(dq)), "dk": rel_err(local[1].grad, sh(dk)),
                        "dv": rel_err(local[2].grad, sh(dv))}
                results.append((strategy, layout, window, errs))
    # gpt-oss's sinks through sinks=: out and the gradients of q, k, v and the sinks
    # (summed over the ranks, as any parameter's)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(8)) * 2
    ref_sinks = sinks.double().requires_grad_()
    qd, kd, vd = (t[None].double().requires_grad_() for t in (q, k, v))
    ro, _ = attention(qd, kd, vd, _docs_ok(cu, True), sinks=ref_sinks)
    (ro * do[None].double()).sum().backward()
    sh = lambda t: ra.shard(t, dim=0, cu_seqlens=cu, layout="zigzag")  # noqa: E731
    local = [sh(t).requires_grad_() for t in (q, k, v)]
    own_sinks = sinks.clone().requires_grad_()
    out = ra.varlen_attention(*local, cu, cu, 19, 19, causal=True, strategy="allgather",
                              sinks=own_sinks)
    (out * sh(do)).sum().backward()
    dsinks = own_sinks.grad.clone()
    dist.all_reduce(dsinks)
    results.append(("allgather", "zigzag", "sinks", {
        "out": rel_err(out, sh(ro[0].detach())), "dq": rel_err(local[0].grad, sh(qd.grad[0])),
        "dk": rel_err(local[1].grad, sh(kd.grad[0])), "dv": rel_err(local[2].grad, sh(vd.grad[0])),
        "dsinks": rel_err(dsinks, ref_sinks.grad)}))
    refusals = []
    q_l = ra.shard(q, dim=0, cu_seqlens=cu)
    rank = dist.get_rank()
    for kwargs in ({"dropout_p": 0.1}, {"max_seqlen_q": 5}, {"cu_seqlens_k": [0, 29]},
                   {"layout": "striped"}, {"casual": True}, {"seqlen": 29},
                   {"dropout_p": 0.1 if rank == 1 else 0.0}, {"k": q_l[:, :3], "v": q_l[:, :3]},
                   {"q": q[:9], "k": k[:9], "v": v[:9], "layout": "contiguous"}):
        args = dict(q=q_l, k=q_l[:, :2], v=q_l[:, :2], cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=19, max_seqlen_k=19, causal=True)
        args.update(kwargs)
        try:
            ra.varlen_attention(**args)
            refusals.append("computed")
        except (TypeError, ValueError) as exc:
            refusals.append(f"{type(exc).__name__}: {exc}")
    return results, refusals


@pytest.mark.timeout(300)
def test_varlen_attention(clusters):
    per_rank = clusters(3).run(varlen_attention_cases, timeout=280)
    for rank, (results, refusals) in enumerate(per_rank):
        for strategy, layout, window, errs in results:
            assert max(errs.values()) <= TOL, (rank, strategy, layout, window, errs)
        assert "dropout_p must be 0" in refusals[0]
        assert "max_seqlen_q must be an int >= the longest document (19" in refusals[1]
        assert "cu_seqlens_q" in refusals[2] and "differ" in refusals[2]
        assert "sharded with layout 'zigzag' but is attended" in refusals[3], refusals[3]
        # its own names and shapes, never the batch API's
        assert refusals[4].startswith("TypeError: ") and (
            "varlen_attention() got an unexpected keyword argument 'casual' (did you mean "
            "'causal'?)") in refusals[4], refusals[4]
        assert "TypeError: " in refusals[5] and "varlen_attention() takes no seqlen=" in refusals[5]
        # one rank's bad value: raised on every rank, by the agreement (no wait)
        assert refusals[6].startswith("ValueError: rank 1: dropout_p must be 0"), refusals[6]
        assert "q has 4 heads, not a multiple of k's 3 heads (dim 1 of [T, H, D]" in refusals[7]
        assert "T=9 on dim 0 of [T, H, D]" in refusals[8] and "S=29" in refusals[8]
        for said in refusals:
            assert "S_local" not in said and "[B" not in said, said
            assert "ring_attention" not in said, said
    assert per_rank[0][1] == per_rank[1][1] == per_rank[2][1]


def _hook_model(family, attn):
    if family == "gpt_oss":  # sinks (s_aux, random), a sliding and a full layer, MoE
        from families import build

        return build("gpt_oss", attn)
    from models import tiny_causal_lm

    return tiny_causal_lm(family, attn)


def _flat_grads(model):
    """Every parameter's gradient, flat (zeros for a parameter that got none)."""
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten()
                      for p in model.parameters()])


def hf_hook_case(family):
    """Rank side: ring-flash-attn's README flow with the import changed: substitute the hook,
    pack three documents, update the params with the global cu_seqlens, feed each rank its
    torch.chunk of input_ids and position_ids; logits, the loss and the all-reduced
    gradients (gpt-oss's sinks included) against the same model run on each document alone
    in one process (sdpa; eager for gpt-oss)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))
    name = rfa.substitute_hf_flash_attn(group, heads_k_stride=1)
    lengths = [7, 11, 6 * world - 6]
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    input_ids = torch.cat(docs).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.cat([torch.tensor([0]), torch.cumsum(torch.tensor(lengths), 0)]).to(torch.int32)
    rfa.update_ring_flash_attn_params(cu, group)
    model = _hook_model(family, name)
    local_ids = torch.chunk(input_ids, world, dim=1)[rank]
    local_pos = torch.chunk(position_ids, world, dim=1)[rank]
    logits = model(input_ids=local_ids, position_ids=local_pos).logits
    weights = torch.randn(input_ids.shape[1], 97, generator=g)
    loss = (logits[0] * torch.chunk(weights, world, dim=0)[rank]).sum()
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    grads = _flat_grads(model)
    dist.all_reduce(grads)
    ref_model = _hook_model(family, "eager" if family == "gpt_oss" else "sdpa")
    ref = torch.cat([ref_model(input_ids=d[None]).logits[0] for d in docs])
    ref_loss = (ref * weights).sum()
    ref_loss.backward()
    ref_grads = _flat_grads(ref_model)
    errs = {"logits": rel_err(logits[0], torch.chunk(ref, world, dim=0)[rank]),
            "loss": rel_err(loss, ref_loss.detach()), "grads": rel_err(grads, ref_grads)}
    sinks = [(p, r) for (n, p), r in zip(model.named_parameters(), ref_model.parameters())
             if n.endswith(".sinks")]
    if sinks:  # their own gradients, summed over the ranks, and not zero
        got = torch.cat([torch.zeros_like(p) if p.grad is None else p.grad for p, _ in sinks])
        dist.all_reduce(got)
        want = torch.cat([r.grad for _, r in sinks])
        errs["sinks"] = rel_err(got, want)
        errs["sinks_moved"] = float(want.abs().max() < 1e-3)  # 0.0: the sinks matter
    return errs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "qwen2-sliding", "gpt_oss"])
def test_hf_hook_as_ring_flash_attn_readme(clusters, family):
    pytest.importorskip("transformers")
    for rank, errs in enumerate(clusters(2).run(hf_hook_case, family, timeout=200)):
        assert max(errs.values()) <= TOL, (rank, family, errs)
        assert family != "gpt_oss" or "sinks" in errs, errs


def refusal_cases():
    """Rank side: arguments only one rank gets wrong (the batch functions' dropout_p or
    packed kv, the varlen and llama3 functions' dropout_p, the hook's dropout) raise the
    same error on every rank at once; the hook refuses what it does not implement, by name;
    a model whose config a later from_config switched to eager is refused, and one whose
    reference was built from a copy runs."""
    import copy

    import transformers as tf
    from ringattn import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    said = {}

    def attempt(key, fn):
        try:
            fn()
            said[key] = "computed"
        except (TypeError, ValueError) as exc:
            said[key] = f"{type(exc).__name__}: {exc}"

    before = comm.get_timeout()
    comm.set_timeout(30.0)  # a rank that raised alone would leave the others waiting
    try:
        q, k, v, _ = _data(1, 8 * world, 4, 2, seed=13)
        loc = [zigzag_local(t, rank, world) for t in (q, k, v)]
        one = 0.1 if rank == 1 else 0.0
        attempt("batch dropout", lambda: rfa.zigzag_ring_flash_attn_func(
            *loc, dropout_p=one, causal=True))
        kv = torch.stack(loc[1:], dim=2)
        attempt("batch kv", lambda: rfa.ring_flash_attn_kvpacked_func(
            loc[0], kv if rank == 1 else kv[:, :, :1], causal=True))
        cu = [0, 4 * world, 8 * world]
        packed = [doc_local(t[0], cu, rank, world, True) for t in (q, k, v)]
        attempt("varlen dropout", lambda: rfa.zigzag_ring_flash_attn_varlen_func(
            *packed, torch.tensor(cu) // world, 4, dropout_p=one, causal=True))
        prepared = rfa.llama3_flash_attn_prepare_cu_seqlens(torch.tensor(cu), True, rank, world)
        sliced = [t[0, rank * 8:(rank + 1) * 8] for t in (q, k, v)]
        attempt("llama3 dropout", lambda: rfa.llama3_flash_attn_varlen_func(
            *sliced, *prepared[:4], 1, prepared[4], dropout_p=0.1 if rank == 0 else 0.0,
            causal=True))
        group = dist.new_group(ranks=list(range(world)))
        name = rfa.substitute_hf_flash_attn(group, heads_k_stride=1)
        rfa.update_ring_flash_attn_params(torch.tensor(cu), group)
        common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(**common)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
        layer = model.model.layers[0].self_attn
        g = torch.Generator().manual_seed(14)  # transformers' [1, heads, T, 16]
        hq, hk, hv = (torch.randn(1, h, 8, 16, generator=g) for h in (4, 2, 2))
        attempt("hook kwarg", lambda: rfa._hf_attention(layer, hq, hk, hv, foo=1))
        attempt("hook dropout", lambda: rfa._hf_attention(layer, hq, hk, hv, dropout=one))
        attempt("hook mask", lambda: rfa._hf_attention(layer, hq, hk, hv, torch.zeros(1, 1, 8, 8)))
        attempt("hook plain", lambda: rfa._hf_attention(layer, hq, hk, hv, position_ids=None,
                                                        use_cache=False))
        ids = torch.arange(8 * world).remainder(97)[None]
        pos = torch.cat([torch.arange(4 * world)] * 2)[None]
        local_ids, local_pos = (t.chunk(world, dim=1)[rank] for t in (ids, pos))
        attempt("first call", lambda: model(input_ids=local_ids, position_ids=local_pos))
        tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")  # the reference
        attempt("switched", lambda: model(input_ids=local_ids, position_ids=local_pos))
        cfg = tf.LlamaConfig(**common)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
        tf.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
        attempt("copied", lambda: model(input_ids=local_ids, position_ids=local_pos))
    finally:
        comm.set_timeout(before)
    return said


@pytest.mark.timeout(120)
def test_refusals_on_every_rank(clusters):
    pytest.importorskip("transformers")
    per_rank = clusters(2).run(refusal_cases, timeout=100)
    assert per_rank[0] == per_rank[1], per_rank
    said = per_rank[0]
    assert said["batch dropout"].startswith("ValueError: rank 1: dropout_p must be 0"), said
    assert said["batch kv"].startswith("ValueError: rank 0: kv must have 2 on dim 2"), said
    assert said["varlen dropout"].startswith("ValueError: rank 1: dropout_p must be 0"), said
    assert said["llama3 dropout"].startswith("ValueError: rank 0: dropout_p must be 0"), said
    assert said["hook kwarg"].startswith("TypeError: ") and (
        "ringattn_varlen does not implement the attention argument(s) ['foo'] that "
        "LlamaAttention passes") in said["hook kwarg"], said
    assert said["hook dropout"].startswith("ValueError: rank 1: dropout_p must be 0"), said
    assert said["hook mask"].startswith("TypeError: ") and (
        "ringattn_varlen got an attention_mask") in said["hook mask"], said
    assert said["hook plain"] == said["first call"] == said["copied"] == "computed", said
    assert said["switched"].startswith("ValueError: LlamaAttention was built to run attention "
                                       "implementation 'ringattn_varlen', but its config now "
                                       "names 'eager'"), said
    assert "copy.deepcopy(cfg)" in said["switched"], said
