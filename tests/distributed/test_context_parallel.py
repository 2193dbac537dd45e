"""``ra_hf.context_parallel``: a custom training loop under the context manager equals the
same loop in one process.

Every rank builds the same tiny Llama twice: with ring attention (run under the manager,
called with the GLOBAL batch) and with transformers' eager attention (the one-process
reference, run on the whole batch in this process). Each SGD step compares, on every rank,
``out.loss`` with the reference loss and EVERY parameter's gradient, once averaged over the
group (by DDP over the group, or by ``average_gradients``), with the reference gradient
(fp32, 1e-5 relative); the weights after the steps too. Batches: plain rows, left and
right padding, packed documents (position ids restarting at 0), S not a multiple of W or
2W; W = 2 and 3. Then the refusals: each raised on every rank, the ranks still in step
afterwards (the next call works); keyword options compared by value (a 0-d tensor
``num_items_in_batch`` that differs is refused; 40, 40.0 and tensor(40) agree, as NaN
does with NaN).
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist

from models import tiny_causal_lm
from reference import rel_err

pytest.importorskip("transformers")

TOL = 1e-5
VOCAB = 97


def _batch(kind: str, seqlen: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    if kind == "packed":  # one row of documents (as DataCollatorWithFlattening makes them)
        cu = [0, 5, 6, 19, seqlen]
        ids = torch.randint(1, VOCAB, (1, seqlen), generator=g)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
        labels = ids.clone()
        labels[0, cu[:-1]] = -100
        return dict(input_ids=ids, labels=labels, position_ids=pos)
    ids = torch.randint(1, VOCAB, (2, seqlen), generator=g)
    batch = dict(input_ids=ids, labels=ids.clone())
    if kind in ("left-padding", "right-padding"):
        keep = torch.ones(2, seqlen, dtype=torch.long)
        if kind == "left-padding":
            keep[1, :6] = 0
        else:
            keep[0, seqlen - 5:] = 0
        ids = ids.masked_fill(keep == 0, 0)
        labels = ids.masked_fill(keep == 0, -100)
        if kind == "left-padding":
            labels[1, 6] = -100  # predicted by a padding token: no target (see shard_batch)
        batch.update(input_ids=ids, labels=labels, attention_mask=keep)
    return batch


def _models():
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    return tiny_causal_lm("llama", "ringattn"), tiny_causal_lm("llama", "eager")


def train_against_one_process(mode, kinds, seqlens, layout, strategy="ring"):
    """Rank side: one SGD step per batch under the manager (``mode`` "ddp": DDP over the
    group; "manual": ``average_gradients``) beside the same loop in one process. Returns
    the worst relative errors of the losses, the gradients and the final weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringattn.integrations import transformers as ra_hf

    model, ref = _models()
    group = dist.group.WORLD
    wrapped = DDP(model, process_group=group) if mode == "ddp" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    worst = {"loss": 0.0, "grads": 0.0, "weights": 0.0}
    losses = []
    with ra_hf.context_parallel(wrapped, group, layout=layout, strategy=strategy):
        for step, (kind, seqlen) in enumerate(zip(kinds, seqlens)):
            batch = _batch(kind, seqlen, seed=step)
            out = wrapped(**batch)
            out.loss.backward()
            if mode == "manual":
                ra_hf.average_gradients(model, group)
            one = ref(**batch, use_cache=False)
            one.loss.backward()
            losses.append(float(out.loss))
            worst["loss"] = max(worst["loss"], rel_err(out.loss.detach(), one.loss.detach()))
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                err = rel_err(p.grad, q.grad)
                worst["grads"] = max(worst["grads"], err if err == err else float("inf"))
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        worst["weights"] = max(worst["weights"], rel_err(p.detach(), q.detach()))
    worst["hooks left"] = len(wrapped._forward_pre_hooks) + len(wrapped._forward_hooks)
    return worst, losses


LOOPS = [  # (mode, world, batch kinds of the steps, their S, layout, strategy)
    ("ddp", 2, ("plain", "left-padding", "packed"), (37, 29, 41), "zigzag", "ring"),
    ("manual", 2, ("right-padding", "plain", "packed"), (31, 33, 30), "striped", "ring"),
    ("ddp", 3, ("left-padding", "packed", "plain"), (37, 35, 40), "zigzag", "ring"),
    ("manual", 3, ("plain", "right-padding", "left-padding"), (29, 31, 34), "contiguous",
     "ring"),
    ("manual", 2, ("left-padding", "packed"), (37, 29), "zigzag", "ulysses"),
    ("manual", 3, ("packed", "left-padding"), (37, 29), "contiguous", "allgather"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode,world,kinds,seqlens,layout,strategy", LOOPS)
def test_loop_equals_one_process(clusters, worst_errors, mode, world, kinds, seqlens, layout,
                                 strategy):
    results = clusters(world).run(train_against_one_process, mode, kinds, seqlens, layout,
                                  strategy, timeout=150)
    for rank, (worst, losses) in enumerate(results):
        assert worst.pop("hooks left") == 0, rank
        for name, err in worst.items():
            key = ("HF model", name)
            worst_errors[key] = (max(worst_errors.get(key, (0.0, TOL))[0], err), TOL)
            assert err < TOL, (rank, name, err)
        assert losses == results[0][1], (rank, losses, results[0][1])  # the same on every rank


def gathered_logits_against_one_process():
    """Rank side: ``gather_logits=True`` gives the whole sequence's logits on every rank
    (with and without labels), and a loss built from them beside ``out.loss`` has, averaged
    over the ranks, the one-process gradient; without it the logits are the local shard."""
    from ringattn.integrations import transformers as ra_hf

    model, ref = _models()
    batch = _batch("left-padding", 37, seed=5)
    real = batch["attention_mask"].bool()
    errs = {}
    with ra_hf.context_parallel(model, gather_logits=True):
        out = model(**batch)
        loss = out.loss + 0.1 * out.logits[real].square().mean()
        loss.backward()
        ra_hf.average_gradients(model)
        scoring = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    one = ref(**batch, use_cache=False)
    (one.loss + 0.1 * one.logits[real].square().mean()).backward()
    errs["logits"] = rel_err(out.logits[real], one.logits[real])
    errs["loss"] = rel_err(loss.detach(), one.loss.detach()
                           + 0.1 * one.logits[real].square().mean().detach())
    errs["grads"] = max(rel_err(p.grad, q.grad)
                        for p, q in zip(model.parameters(), ref.parameters()))
    errs["logits without labels"] = rel_err(scoring.logits[real], one.logits[real])
    with ra_hf.context_parallel(model, layout="striped"):
        local = model(input_ids=batch["input_ids"])
    shapes = (tuple(out.logits.shape), scoring.loss, tuple(local.logits.shape))
    return errs, shapes


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_gathered_logits(clusters, worst_errors, world):
    for rank, (errs, shapes) in enumerate(clusters(world).run(gathered_logits_against_one_process,
                                                              timeout=150)):
        for name, err in errs.items():
            key = ("HF model", name.split()[0])
            worst_errors[key] = (max(worst_errors.get(key, (0.0, TOL))[0], err), TOL)
            assert err < TOL, (rank, name, err)
        assert shapes == ((2, 37, VOCAB), None, (2, -(-37 // world), VOCAB)), (rank, shapes)


def _refused(fn) -> tuple | None:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


def refusals():
    """Rank side: each refusal, as (exception class, message) or None when nothing was
    raised; then a step that must still equal one process (the ranks stayed in step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringattn.integrations import transformers as ra_hf

    rank = dist.get_rank()
    model, ref = _models()
    batch = _batch("plain", 23, seed=7)
    seen = {}
    seen["eager model"] = _refused(lambda: ra_hf.context_parallel(ref).__enter__())
    seen["unknown strategy"] = _refused(
        lambda: ra_hf.context_parallel(model, strategy="rings").__enter__())
    with ra_hf.context_parallel(model):
        seen["nested"] = _refused(lambda: ra_hf.context_parallel(model).__enter__())
        other = dict(batch, input_ids=batch["input_ids"].clone())
        if rank == 1:
            other["input_ids"][0, 3] += 1  # one token differs on one rank
        seen["other tokens on rank 1"] = _refused(lambda: model(**other))
        longer = _batch("plain", 24 if rank == 0 else 23, seed=7)
        seen["other S on rank 0"] = _refused(lambda: model(**longer))
        masked = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
        if rank == 0:
            masked.pop("attention_mask")  # an argument only some ranks pass
        seen["attention_mask on some ranks"] = _refused(lambda: model(**masked))
        if rank == 1:
            seen["positional on rank 1"] = _refused(lambda: model(batch["input_ids"]))
        else:
            seen["positional on rank 1"] = _refused(lambda: model(**batch))
        seen["inputs_embeds"] = _refused(lambda: model(
            **batch, inputs_embeds=torch.zeros(1, 23, 64)))
        seen["return_dict=False"] = _refused(lambda: model(**batch, return_dict=False))
        seen["logits_to_keep=1"] = _refused(lambda: model(**batch, logits_to_keep=1))
        seen["generate"] = _refused(lambda: model.generate(
            input_ids=batch["input_ids"], max_new_tokens=2, do_sample=False))
        # keyword options by value: a 0-d tensor that differs is refused, NaN against a
        # number too; the same value as an int, a float or a tensor agrees (one result)
        seen["num_items_in_batch differing tensors"] = _refused(lambda: model(
            **batch, num_items_in_batch=torch.tensor(41 if rank == 1 else 40)))
        seen["num_items_in_batch NaN on rank 0"] = _refused(lambda: model(
            **batch, num_items_in_batch=math.nan if rank == 0 else 40.0))
        with torch.no_grad():
            count = (40, 40.0, torch.tensor(40))[rank % 3]
            counted = model(**batch, num_items_in_batch=count).loss
            nan = torch.tensor(math.nan) if rank == 1 else math.nan
            seen["num_items_in_batch NaN everywhere"] = _refused(
                lambda: model(**batch, num_items_in_batch=nan))
            counted_ref = ref(**batch, use_cache=False, num_items_in_batch=40).loss
        out = model(**batch)  # still in step after every refusal
        out.loss.backward()
        ra_hf.average_gradients(model)
    try:
        with ra_hf.context_parallel(model):
            raise RuntimeError("the loop failed")
    except RuntimeError:
        pass
    hooks = len(model._forward_pre_hooks) + len(model._forward_hooks)
    seen["after exit"] = _refused(lambda: model(**batch, use_cache=False))  # no ring_context
    wrapped = DDP(model)
    with ra_hf.context_parallel(wrapped):
        seen["the wrapped model too"] = _refused(lambda: ra_hf.context_parallel(model).__enter__())
    with ra_hf.context_parallel(model):  # re-entering after exit is allowed
        again = model(**batch)
    one = ref(**batch, use_cache=False)
    one.loss.backward()
    errs = {"loss": rel_err(out.loss.detach(), one.loss.detach()),
            "again": rel_err(again.loss.detach(), one.loss.detach()),
            "num_items_in_batch as 40, 40.0, tensor(40)": rel_err(counted, counted_ref),
            "grads": max(rel_err(p.grad, q.grad)
                         for p, q in zip(model.parameters(), ref.parameters()))}
    return seen, hooks, errs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_refusals_on_every_rank(clusters, world):
    results = clusters(world).run(refusals, timeout=150)
    for rank, (seen, hooks, errs) in enumerate(results):
        expect = {  # (class, words the message holds)
            "eager model": ("ValueError", "runs attention implementation 'eager'"),
            "unknown strategy": ("ValueError", "unknown strategy 'rings'"),
            "nested": ("ValueError", "already active on LlamaForCausalLM"),
            "other tokens on rank 1": ("ValueError", "ranks disagree on input_ids: "),
            "other S on rank 0": ("ValueError", "ranks disagree on input_ids's S: rank 0 has 24"),
            "attention_mask on some ranks": ("ValueError",
                                             "ranks disagree on attention_mask's dims"),
            "positional on rank 1": ("TypeError", "rank 1: under context_parallel call the "
                                                  "model with keyword arguments"),
            "inputs_embeds": ("TypeError", "['inputs_embeds']"),
            "return_dict=False": ("TypeError", "return_dict=False"),
            "logits_to_keep=1": ("TypeError", "logits_to_keep=1 would keep"),
            "generate": ("ValueError", "carries a KV cache"),
            "after exit": ("ValueError", "needs the batch's ring_context"),
            "the wrapped model too": ("ValueError", "already active on LlamaForCausalLM"),
            "num_items_in_batch differing tensors": (
                "ValueError", "ranks disagree on num_items_in_batch: "),
            "num_items_in_batch NaN on rank 0": ("ValueError", "rank 0 has nan"),
        }
        assert seen.pop("num_items_in_batch NaN everywhere") is None, rank  # agreed, no hang
        assert "rank 1 has 41" in seen["num_items_in_batch differing tensors"][1], rank
        assert set(seen) == set(expect), (rank, sorted(seen))
        for case, (cls, words) in expect.items():
            assert seen[case] is not None and seen[case][0] == cls, (rank, case, seen[case])
            assert words in seen[case][1], (rank, case, seen[case][1])
        assert hooks == 0, rank
        for name, err in errs.items():
            assert err < TOL, (rank, name, err)


def accumulation_against_one_process():
    """Rank side: two micro-batches per optimizer step, each called with the caller's
    ``num_items_in_batch`` (the targets of both, counted on the global batches as one
    process counts them): the manager keeps the caller's count. Worst errors of the loss and
    the averaged gradients against the same accumulation in one process."""
    from ringattn.integrations import transformers as ra_hf

    model, ref = _models()
    micro = [_batch("plain", 29, seed=11), _batch("right-padding", 29, seed=12)]
    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
    total, one_total = 0.0, 0.0
    with ra_hf.context_parallel(model):
        for b in micro:
            out = model(**b, num_items_in_batch=torch.tensor(count))
            out.loss.backward()
            total += float(out.loss)
    ra_hf.average_gradients(model)
    for b in micro:
        one = ref(**b, num_items_in_batch=torch.tensor(count), use_cache=False)
        one.loss.backward()
        one_total += float(one.loss)
    return {"loss": abs(total - one_total) / abs(one_total),
            "grads": max(rel_err(p.grad, q.grad)
                         for p, q in zip(model.parameters(), ref.parameters()))}


@pytest.mark.timeout(180)
def test_gradient_accumulation(clusters):
    for rank, errs in enumerate(clusters(2).run(accumulation_against_one_process, timeout=150)):
        for name, err in errs.items():
            assert err < TOL, (rank, name, err)


# The user docs' blocks (docs/trainers.md, "Custom training loops"), verbatim; the names the
# page says are the reader's: config, batches (the same global batches on every rank),
# cp_group.
DOCS_DDP = '''\
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM
from ringattn.integrations import transformers as ra_hf

ra_hf.register()
model = AutoModelForCausalLM.from_config(config, attn_implementation="ringattn")
ddp = DDP(model, process_group=cp_group)          # averages gradients over the group
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with ra_hf.context_parallel(ddp, cp_group, layout="zigzag"):
    for batch in batches:                         # the same global batch on every rank
        out = ddp(**batch)                        # input_ids, labels, attention_mask, ...
        out.loss.backward()                       # out.loss: the one-process loss
        optimizer.step()
        optimizer.zero_grad()
'''

DOCS_MANUAL = '''\
from ringattn.integrations import transformers as ra_hf

with ra_hf.context_parallel(model, cp_group):
    for batch in batches:
        out = model(**batch)
        out.loss.backward()
        ra_hf.average_gradients(model, cp_group)   # without DDP: average over the group
        optimizer.step()
        optimizer.zero_grad()
'''


def docs_inputs(ns: dict) -> None:
    """The reader's names for the docs' blocks: a tiny Llama config (the seed fixed so that
    the check can build the same initial weights), three global batches, the group."""
    import transformers as tf

    torch.manual_seed(0)
    ns.update(config=tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2),
              batches=[_batch("left-padding", 29, 1), _batch("packed", 31, 2),
                       _batch("plain", 27, 3)],
              cp_group=dist.group.WORLD)


def docs_check(ns: dict, steps: int) -> float:
    """The worst relative error of the block's model weights after ``steps`` passes over the
    batches against one process running the same SGD loop, with eager attention, from the
    same initial weights (``docs_inputs``'s seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # a copy: from_config sets the attention implementation on the config it is given,
    # which is the block model's own
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(ns["config"]),
                                           attn_implementation="eager")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        for batch in ns["batches"]:
            ref(**batch, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
    return max(rel_err(p.detach(), q.detach())
               for p, q in zip(ns["model"].parameters(), ref.parameters()))


def docs_blocks_as_printed():
    """Rank side: the DDP block, then the block without DDP on the same model and
    optimizer (a second pass over the batches); the weights after each equal one
    process's."""
    ns: dict = {"__name__": "__doc_block__"}
    docs_inputs(ns)
    exec(compile(DOCS_DDP, "docs block (DDP)", "exec"), ns)
    after_ddp = docs_check(ns, steps=1)
    exec(compile(DOCS_MANUAL, "docs block (no DDP)", "exec"), ns)
    return after_ddp, docs_check(ns, steps=2)


@pytest.mark.timeout(180)
def test_docs_blocks(clusters):
    for rank, errs in enumerate(clusters(2).run(docs_blocks_as_printed, timeout=150)):
        assert max(errs) < TOL, (rank, errs)
