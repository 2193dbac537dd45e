"""The tiled loss of a whole model under context parallelism (``context_parallel``'s
``loss_tile``, on by default): the loss and EVERY gradient equal the same model's untiled
loss in one process (float32 both, 1e-5 relative, as the family survey; a NaN fails), on every rank, for a plain head, a soft
cap (Gemma 2), a scale (Cohere), a divisor (Granite), a scaled input (MiniCPM3) and a
converted MoE router loss (Mixtral) and a head with a bias (Phi); plain, left-padded and packed rows; tiles of 1, 5 and
more than the shard; W = 2 and 3, and S = 2 at W = 3 (a rank with no token). The tiled
path is the one that ran: ``out.logits`` is a ``LogitsNotComputed`` (the untiled path
returns them). A head
that does something the table does not say is refused on every rank, naming the family.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from families import build
from reference import rel_err

pytest.importorskip("transformers")

TOL = 1e-5
VOCAB = 97


def _batch(kind: str, seqlen: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    if kind == "packed":
        cu = [0, 5, 6, seqlen]
        ids = torch.randint(3, VOCAB, (1, seqlen), generator=g)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
        labels = ids.clone()
        labels[0, cu[:-1]] = -100
        return dict(input_ids=ids, labels=labels, position_ids=pos)
    ids = torch.randint(3, VOCAB, (2, seqlen), generator=g)
    batch = dict(input_ids=ids, labels=ids.clone())
    if kind == "left-padding":
        keep = torch.ones(2, seqlen, dtype=torch.long)
        keep[1, :4] = 0
        ids = ids.masked_fill(keep == 0, 0)
        labels = ids.masked_fill(keep == 0, -100)
        labels[1, 4] = -100
        batch.update(input_ids=ids, labels=labels, attention_mask=keep)
    return batch


def _pair(name: str):
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model, ref = build(name, "ringattn"), build(name, "eager")
    if name == "mixtral":
        ra_hf.convert(model)
    return model, ref


CASES = [  # (family, batch kind, S, tile)
    ("llama", "plain", 37, 5), ("llama", "packed", 33, 1), ("llama", "left-padding", 30, 64),
    ("gemma2", "plain", 37, 5), ("gemma2", "left-padding", 29, 3),
    ("cohere", "plain", 31, 4), ("granite", "packed", 35, 5), ("minicpm3", "plain", 37, 6),
    ("mixtral", "plain", 37, 5), ("mixtral", "left-padding", 31, 2),
    ("phi", "plain", 33, 4),  # a head with a bias
]


def _worse(a: float, b: float) -> float:
    return float("inf") if b != b else max(a, b)  # NaN: the worst


def tiled_against_one_process(cases):
    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.transformers.head import LogitsNotComputed

    group = dist.group.WORLD
    worst, seen = {"loss": 0.0, "grads": 0.0}, []
    for step, (name, kind, seqlen, tile) in enumerate(cases):
        model, ref = _pair(name)
        batch = _batch(kind, seqlen, seed=step)
        with ra_hf.context_parallel(model, group, loss_tile=tile):
            out = model(**batch)
            seen.append(isinstance(out.logits, LogitsNotComputed))
            out.loss.backward()
        ra_hf.average_gradients(model, group)
        one = ref(**batch, use_cache=False)
        one.loss.backward()
        worst["loss"] = _worse(worst["loss"], rel_err(out.loss, one.loss))
        for p, q in zip(model.parameters(), ref.parameters()):
            worst["grads"] = _worse(worst["grads"], rel_err(p.grad, q.grad))
    return worst, seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_tiled_loss_equals_one_process(clusters, worst_errors, world):
    cases = CASES if world == 2 else CASES[1::2]  # W = 3: every other case
    for rank, (worst, seen) in enumerate(clusters(world).run(
            tiled_against_one_process, cases, timeout=280)):
        assert all(seen), (rank, seen)  # the tiled path ran
        for name, err in worst.items():
            assert err <= TOL, (rank, name, err)
            key = ("tiled", name)
            worst_errors[key] = (max(err, worst_errors.get(key, (0.0, TOL))[0]), TOL)


@pytest.mark.timeout(120)
def test_a_rank_with_no_token(clusters):
    cases = [("llama", "plain", 2, 1), ("gemma2", "plain", 2, 4)]
    for rank, (worst, seen) in enumerate(clusters(3).run(tiled_against_one_process, cases,
                                                          timeout=100)):
        assert all(seen) and max(worst.values()) <= TOL, (rank, worst)


def untiled_and_refused():
    """Untiled with ``loss_tile=None`` and with ``gather_logits`` (logits returned, the same
    loss); a model with a forward of its own runs untiled; a family whose head soft-caps its
    logits where the table says nothing is refused on every rank (and the ranks stay in
    step)."""
    from transformers import LlamaForCausalLM

    from ringattn.integrations import transformers as ra_hf

    group = dist.group.WORLD
    model, ref = _pair("llama")
    batch = _batch("plain", 23, seed=1)
    one = ref(**batch, use_cache=False)
    results = {}
    for label, kw in (("none", {"loss_tile": None}), ("gathered", {"gather_logits": True})):
        with ra_hf.context_parallel(model, group, **kw):
            out = model(**batch)
        results[label] = (isinstance(out.logits, torch.Tensor), rel_err(out.loss, one.loss))

    class Capped(LlamaForCausalLM):  # a head the table does not know (a custom family)
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            hidden = self.model(input_ids=input_ids, **{k: v for k, v in kwargs.items()
                                                        if k not in ("shift_labels",
                                                                     "num_items_in_batch")})[0]
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) \
                else logits_to_keep
            logits = torch.tanh(self.lm_head(hidden[:, keep]) / 2.0) * 2.0
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, self.config.vocab_size,
                                          shift_labels=kwargs.get("shift_labels"),
                                          num_items_in_batch=kwargs.get("num_items_in_batch"))
            from transformers.modeling_outputs import CausalLMOutputWithPast
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    capped = Capped(model.config)  # a forward of its own: untiled, its own loss
    results["capped untiled"] = ra_hf.tile_problem(capped)
    with ra_hf.context_parallel(capped, group):
        results["capped logits"] = isinstance(capped(**batch).logits, torch.Tensor)
    # a transformers family whose head transform the table does not say (its row removed):
    # the check against the model's own logits refuses it on every rank
    from ringattn.integrations.transformers import head

    gemma, row = build("gemma2", "ringattn"), head.TRANSFORMS.pop("gemma2")
    try:
        with ra_hf.context_parallel(gemma, group):
            gemma(**batch)
        results["unknown"] = "ran"
    except ValueError as exc:
        results["unknown"] = str(exc)
    finally:
        head.TRANSFORMS["gemma2"] = row
    with ra_hf.context_parallel(model, group):  # still in step
        out = model(**batch)
    results["after"] = rel_err(out.loss, one.loss)
    return results


@pytest.mark.timeout(120)
def test_untiled_options_and_an_unknown_head(clusters):
    for rank, res in enumerate(clusters(2).run(untiled_and_refused, timeout=100)):
        assert res["none"][0] and res["none"][1] <= TOL, (rank, res)
        assert res["gathered"][0] and res["gathered"][1] <= TOL, (rank, res)
        assert "Capped's forward is not one of transformers'" in res["capped untiled"], res
        assert res["capped logits"], (rank, res)
        assert "Gemma2ForCausalLM (gemma2) transforms its head's logits" in res["unknown"]
        assert "loss_tile=None" in res["unknown"], (rank, res)
        assert res["after"] <= TOL, (rank, res)


def test_loss_tile_is_checked():
    from ringattn.loss import check_tile

    with pytest.raises(ValueError, match="loss_tile must be an int >= 1, got 0"):
        check_tile(0, "loss_tile")
    with pytest.raises(TypeError, match="loss_tile must be an int"):
        check_tile(True, "loss_tile")


class LoRAHead(torch.nn.Linear):
    """A LoRA output head as loralib writes it (a ``torch.nn.Linear`` subclass adding
    ``(x A^T) B^T s``); B starts at zero, so its logits equal the plain head's."""

    def __init__(self, base: torch.nn.Linear, b_scale: float = 0.0):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(3)
        self.lora_A = torch.nn.Parameter(torch.randn(2, base.in_features, generator=g) * 0.1)
        self.lora_B = torch.nn.Parameter(torch.randn(base.out_features, 2, generator=g) * b_scale)

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * 0.5


def _all_grads_err(model, ref) -> float:
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                return float("inf")
            continue
        worst = _worse(worst, rel_err(p.grad, q.grad))
    return worst


def structure_terms_and_conventions():
    """Issue 46's cases, each against one process, on every rank: an adapter head (LoRA, B
    zero and not), a hooked head, Bamba's z-loss, ``ignore_index=-1``, packed rows with
    labels = input_ids through every entry point, and the logits the tiled loss did not
    compute."""
    from ringattn import shard_batch, tiled_lm_loss
    from ringattn.integrations import transformers as ra_hf

    group = dist.group.WORLD
    res = {}
    batch = _batch("plain", 23, seed=5)
    def step(model, ref):  # (loss error, worst gradient error) against one process
        with ra_hf.context_parallel(model, group):
            out = model(**batch)
            out.loss.backward()
        ra_hf.average_gradients(model, group)
        one = ref(**batch, use_cache=False)
        one.loss.backward()
        return rel_err(out.loss, one.loss), _all_grads_err(model, ref)

    for label, b_scale in (("lora zero B", 0.0), ("lora", 0.3)):
        model, ref = _pair("llama")
        model.lm_head, ref.lm_head = LoRAHead(model.lm_head, b_scale), LoRAHead(ref.lm_head, b_scale)
        res[label + " untiled because"] = ra_hf.tile_problem(model)
        res[label] = (*step(model, ref), float(model.lm_head.lora_B.grad.abs().max()))
    model, ref = _pair("llama")  # a plain head with a hook of its own: untiled, exact
    for m in (model, ref):
        m.lm_head.register_forward_hook(lambda mod, args, out: out * 0.5)
    res["hooked untiled because"] = ra_hf.tile_problem(model)
    res["hooked"] = step(model, ref)

    bamba = build("bamba", "ringattn")  # a z-loss: refused by name, on every rank
    ra_hf.convert(bamba)
    bamba.z_loss_coefficient = 0.1
    for entry in ("context_parallel", "prepare_batch"):
        try:
            if entry == "context_parallel":
                with ra_hf.context_parallel(bamba, group):
                    bamba(**batch)
            else:
                ra_hf.prepare_batch(bamba, batch, group=group)
            res["z-loss " + entry] = "ran"
        except ValueError as exc:
            res["z-loss " + entry] = str(exc)

    # ignore_index=-1: labels that mark no target with -1, tiled and untiled, and
    # prepare_batch's shard for model(**local); -100 beside it is refused
    minus = batch["labels"].clone()
    minus[0, 3:6] = -1
    minus[1, 10] = -1
    one_labels = minus.masked_fill(minus == -1, -100)
    model, ref = _pair("llama")
    one = ref(**{**batch, "labels": one_labels}, use_cache=False)
    for label, kw in (("tiled", {}), ("untiled", {"loss_tile": None})):
        with ra_hf.context_parallel(model, group, ignore_index=-1, **kw):
            res["ignore -1 " + label] = rel_err(model(**{**batch, "labels": minus}).loss,
                                                one.loss)
    local = ra_hf.prepare_batch(model, {**batch, "labels": minus}, group=group, ignore_index=-1)
    share = model(**local).loss.detach().clone()
    dist.all_reduce(share, group=group)
    res["ignore -1 prepare_batch"] = rel_err(share, one.loss)
    try:
        with ra_hf.context_parallel(model, group, ignore_index=-1):
            both = minus.clone()
            both[0, 8] = -100
            model(**{**batch, "labels": both})
        res["ignore -1 beside -100"] = "ran"
    except ValueError as exc:
        res["ignore -1 beside -100"] = str(exc)

    # packed rows, labels = input_ids: every entry point counts the cross-document targets
    # one process counts
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (1, 29), generator=g)
    pos = torch.cat([torch.arange(n) for n in (9, 1, 12, 7)])[None]
    packed = dict(input_ids=ids, labels=ids.clone(), position_ids=pos)
    model, ref = _pair("llama")
    one = ref(**packed, use_cache=False)
    with ra_hf.context_parallel(model, group):
        res["packed context_parallel"] = rel_err(model(**packed).loss, one.loss)
    local = ra_hf.prepare_batch(model, packed, group=group)
    share = model(**local).loss.detach().clone()
    dist.all_reduce(share, group=group)
    res["packed prepare_batch"] = rel_err(share, one.loss)
    local = shard_batch(packed, group=group)
    hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                         ring_context=local["ring_context"]).last_hidden_state
    share = tiled_lm_loss(hidden, model.lm_head, shift_labels=local["shift_labels"],
                          num_items_in_batch=local["num_items_in_batch"], tile=4).detach()
    dist.all_reduce(share, group=group)
    res["packed shard_batch + tiled_lm_loss"] = rel_err(share, one.loss)

    # the logits the tiled loss did not compute: every use says how to get them
    with ra_hf.context_parallel(model, group):
        out = model(**batch)
    said = []
    for use in (lambda x: x[:, :-1], lambda x: x.argmax(-1), lambda x: torch.argmax(x),
                lambda x: x.shape, lambda x: len(x), lambda x: x + 1):
        try:
            use(out.logits)
            said.append("no error")
        except ValueError as exc:
            said.append(str(exc))
    res["logits"] = said
    res["logits repr"] = repr(out.logits)
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_structure_loss_terms_and_one_convention(clusters, world):
    for rank, res in enumerate(clusters(world).run(structure_terms_and_conventions,
                                                   timeout=280)):
        for label in ("lora zero B", "lora"):
            loss_err, grad_err, b_grad = res[label]
            assert loss_err <= TOL and grad_err <= TOL, (rank, label, res[label])
            assert b_grad > 1e-4, (rank, label, b_grad)  # the adapter trains
            assert "LoRAHead, not exactly a torch.nn" in res[label + " untiled because"]
        assert "hook (forward_hooks" in res["hooked untiled because"], res
        assert max(res["hooked"]) <= TOL, (rank, res["hooked"])
        for entry in ("context_parallel", "prepare_batch"):
            said = res["z-loss " + entry]
            assert "bamba adds a z-loss (z_loss_coefficient=0.1)" in said, (rank, entry, said)
        for key in ("ignore -1 tiled", "ignore -1 untiled", "ignore -1 prepare_batch",
                    "packed context_parallel", "packed prepare_batch",
                    "packed shard_batch + tiled_lm_loss"):
            assert res[key] <= TOL, (rank, key, res[key])
        assert "labels hold -100, which transformers' loss ignores, while ignore_index=-1" \
            in res["ignore -1 beside -100"], (rank, res["ignore -1 beside -100"])
        assert all("loss_tile=None" in s and "gather_logits=True" in s for s in res["logits"]), \
            (rank, res["logits"])
        assert res["logits repr"].startswith("LogitsNotComputed(out.logits was not computed")
