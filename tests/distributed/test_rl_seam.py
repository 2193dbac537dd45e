"""The packed-sequence seam of RL frameworks, with ``ringattn.tiled_logprobs``: a batch of
documents packed into one row without padding, the targets rolled on the whole row first,
then cut into contiguous slices (OpenRLHF through ring-flash-attn's API, verl through
``position_ids``). Each rank's per-token log-probabilities and entropies, and the gradients
of a weighted sum of them (all-reduced), equal one process running each document alone,
for documents whose total does not divide W (W = 2, 31 tokens; fp32):

* through ringattn's ring-flash-attn shim (``substitute_hf_flash_attn``,
  ``update_ring_flash_attn_params``, each rank fed ``torch.chunk(x, W, dim=1)[rank]``);
* through ``ra_hf.prepare_batch`` with ``layout="contiguous"`` and ``cu_seqlens`` (its
  ``shift_labels``: the same rolled targets).

What does not fit the seam is refused by name on every rank: a packed row of two rows, or
ring-flash-attn's hook without its offsets."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ringattn as ra

LENGTHS = (7, 12, 5, 7)  # 31 tokens: divides neither 2 nor 3
VOCAB, TEMPERATURE, TOL = 97, 0.8, 1e-5


def _model(attn: str):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    return tf.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn)


def _packed():
    g = torch.Generator().manual_seed(21)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(LENGTHS), 0).tolist()], dtype=torch.int32)
    weights = torch.randn(2, ids.shape[1], generator=g)  # of the log-probs and the entropies
    weights[0, -1] = 0.0  # the row's last target: the roll's wrap-around, none for shard_batch
    return docs, ids, pos, cu, weights


def _reference(docs, weights):
    """One process, each document alone (sdpa), the untiled log-softmax: (log-probs,
    entropies) of the packed row's rolled targets, and the parameters' gradients."""
    model = _model("sdpa")
    rolled = torch.roll(torch.cat(docs), -1)  # a document's last target: the next's first
    logits = torch.cat([model(input_ids=d[None]).logits[0] for d in docs]).float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, rolled[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return lp.detach(), ent.detach(), grads


def _grads(model):
    g = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten()
                   for p in model.parameters()])
    dist.all_reduce(g)
    return g


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def seam_cases():
    """{path: worst relative error on this rank} (log-probs, entropies of this rank's
    positions; the all-reduced gradients)."""
    from ringattn.compat import ring_flash_attn as rfa
    from ringattn.integrations import transformers as ra_hf

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))
    docs, ids, pos, cu, weights = _packed()
    ref_lp, ref_ent, ref_grads = _reference(docs, weights)
    rolled = torch.roll(ids, -1, dims=1)  # OpenRLHF rolls the whole packed row first
    out = {}

    # OpenRLHF's seam: ring-flash-attn's transformers hook, contiguous torch.chunk slices
    name = rfa.substitute_hf_flash_attn(group, heads_k_stride=1)
    rfa.update_ring_flash_attn_params(cu, group)
    model = _model(name)
    mine = [torch.chunk(t, world, dim=1)[rank] for t in (ids, pos, rolled)]
    hidden = model.model(input_ids=mine[0], position_ids=mine[1]).last_hidden_state
    got = ra.tiled_logprobs(hidden, model.lm_head, shift_labels=mine[2],
                            temperature=TEMPERATURE, entropy=True, tile=4)
    w = torch.chunk(weights, world, dim=1)[rank]
    ((got.logprobs[0] * w[0]).sum() + (got.entropy[0] * w[1]).sum()).backward()
    ref_mine = [torch.chunk(t[None], world, dim=1)[rank][0] for t in (ref_lp, ref_ent)]
    out["ring-flash-attn shim"] = max(_rel(got.logprobs[0], ref_mine[0]),
                                      _rel(got.entropy[0], ref_mine[1]),
                                      _rel(_grads(model), ref_grads))

    # the same row through prepare_batch: contiguous layout, the documents as cu_seqlens
    ra_hf.register()
    model = _model(ra_hf.NAME)
    local = ra_hf.prepare_batch(model, {"input_ids": ids, "labels": ids, "cu_seqlens": cu},
                                group=group, layout="contiguous")
    ctx = local["ring_context"]
    hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                         ring_context=ctx).last_hidden_state
    ctx.check_consumed(model)
    got = ra.tiled_logprobs(hidden, model.lm_head, shift_labels=local["shift_labels"],
                            temperature=TEMPERATURE, entropy=True, tile=4)
    w = ra.shard(weights.t()[None], group=group, layout="contiguous", seqlen=ids.shape[1],
                 cu_seqlens=cu)[0]  # [L, 2]: this rank's slots of both weight rows
    ((got.logprobs[0] * w[:, 0]).sum() + (got.entropy[0] * w[:, 1]).sum()).backward()
    both = ra.unshard(torch.stack([got.logprobs, got.entropy], -1).detach(), group=group,
                      layout="contiguous", seqlen=ids.shape[1], cu_seqlens=cu)[0]
    has = torch.ones(ids.shape[1], dtype=torch.bool)
    has[-1] = False  # the row's last token has no target (shard_batch): log-prob 0
    out["prepare_batch, contiguous, cu_seqlens"] = max(
        _rel(both[has, 0], ref_lp[has]), float(both[~has, 0].abs().max()),
        _rel(both[:, 1], ref_ent), _rel(_grads(model), ref_grads))

    # refused by name on every rank: two packed rows; the hook without its offsets
    said = {}
    rfa.update_ring_flash_attn_params(cu, group)
    hooked = _model(name)
    try:
        two = torch.cat([mine[0], mine[0]])
        hooked.model(input_ids=two, position_ids=torch.cat([mine[1], mine[1]]))
        said["two rows"] = "computed"
    except ValueError as exc:
        said["two rows"] = str(exc)
    rfa._HFState.cu_seqlens = None
    try:
        hooked.model(input_ids=mine[0], position_ids=mine[1])
        said["no offsets"] = "computed"
    except (TypeError, ValueError) as exc:
        said["no offsets"] = str(exc)
    out["refusals"] = said
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2])  # 31 tokens: chunks of 16 and 15
def test_packed_seam_gives_one_process_logprobs(clusters, world):
    pytest.importorskip("transformers")
    results = clusters(world).run(seam_cases, timeout=200)
    said = [res.pop("refusals") for res in results]
    for rank, res in enumerate(results):
        for path, err in res.items():
            assert err <= TOL, (world, rank, path, err)
        assert said[rank] == said[0], said  # the same words on every rank
    assert "batch of one" in said[0]["two rows"], said[0]
    assert "update_ring_flash_attn_params" in said[0]["no offsets"], said[0]
