"""ModelOpt's Eagle3 training under context parallelism (ringattn.integrations.modelopt)
equals ModelOpt's OWN one-process training, and ModelOpt's own CP does not.

Target: a tiny random Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, vocabulary 128);
ModelOpt 0.47's ``EAGLE3_DEFAULT_CFG`` (3 TTT steps, decay 0.9) with the draft's heads matched
to the target and ``eagle_use_torch_compile=False``. Data: S = 13 (not a multiple of 2W for
W = 2, 3), three right-padded rows of 13, 9 and 11 tokens, a new batch per step; 5 SGD steps
(lr 1), fp32. The reference is ``HFEagleModel`` itself in one process (the rotary fix that
transformers 5.24 needs is the one line docs/modelopt.md gives ModelOpt users).

Tolerance 1e-5 relative (``FP32_TOL``): the ring and the global sums reorder float32
additions; the measured errors are about 2e-7 (losses) and 2e-6 (per-parameter gradients).
SGD, not AdamW: Adam's first updates are about lr * sign(g), and the sign of a near-zero
gradient element is decided by rounding, so later steps would drift far above it.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import modelopt.torch.speculative as mtsp
from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
from modelopt.torch.speculative.utils import get_ttt_msk_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, when torchrun runs this
from reference import FP32_TOL, rel_err  # noqa: E402
from ringattn.integrations import modelopt as ra_mo

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, STEPS = 128, 64, 4, 2, 16, 13, 5
LENGTHS = (13, 9, 11)
CASES = [  # (draft vocabulary (0: the target's), offline, ttt_padding, teacher, tile)
    (64, False, "modelopt", "auto", "16MiB"), (0, False, "modelopt", "auto", "16MiB"),
    (64, True, "modelopt", "auto", "16MiB"), (0, True, "modelopt", "auto", "16MiB"),
    (64, False, "every_step", "auto", "16MiB"),
    # tiles of 2 and 5 rows: several per shard, the last one short
    (64, False, "modelopt", "tiled", 2), (0, True, "every_step", "tiled", 5),
    # ModelOpt's [L, V] base logits and [L, Vd] draft logits
    (64, False, "modelopt", "logits", "16MiB"), (0, True, "modelopt", "logits", "16MiB"),
]


class OneProcessLlama(LlamaForCausalLM):
    """The reference target: its own ``forward`` keeps ModelOpt's registry from taking it for
    the ``LlamaForCausalLM`` that ``ra_mo.register`` gives to ``RingEagleModel``, so
    ``mtsp.convert`` makes it ModelOpt's own ``HFEagleModel``."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def _target(cls, attn: str):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0)
    cfg._attn_implementation = attn
    return cls(cfg).float().eval()


def _eagle_config(draft_vocab: int, offline: bool) -> dict:
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg.update(eagle_use_torch_compile=False, eagle_offline=offline)
    arch = cfg["eagle_architecture_config"]
    arch.update(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                intermediate_size=128)
    if draft_vocab:
        arch["draft_vocab_size"] = draft_vocab
    return cfg


def _convert(model, draft_vocab: int, offline: bool):
    torch.manual_seed(1)
    mtsp.convert(model, [("eagle", _eagle_config(draft_vocab, offline))])
    em = model.eagle_module
    if not hasattr(em, "rotary_emb"):  # plain ModelOpt on transformers >= 5.19 (see docs)
        em.rotary_emb = LlamaRotaryEmbedding(config=em.config)
    if hasattr(em, "d2t"):  # draft id i -> target id 2 i
        n = em.d2t.numel()
        em.d2t.copy_(torch.arange(n))
    return model.train()


def _batches(seq: int = SEQ, lengths=LENGTHS, seed: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (len(lengths), seq), generator=g)
        mask = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


@torch.no_grad()
def _offline_outputs(base, batch: dict, aux_layers) -> dict:
    """What ModelOpt's hidden-state dump holds: the last (post-norm) hidden states and the
    aux layers' outputs concatenated."""
    keep = []
    hooks = [base.model.layers[i].register_forward_hook(
        lambda m, a, o: keep.append(o if isinstance(o, torch.Tensor) else o[0]))
        for i in aux_layers]
    out = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
               output_hidden_states=True)
    for h in hooks:
        h.remove()
    return {"base_model_hidden_states": out.hidden_states[-1],
            "aux_hidden_states": torch.cat(keep, dim=-1)}


def _data(draft_vocab: int, offline: bool) -> list[dict]:
    data = _batches()
    if offline:
        base = _target(LlamaForCausalLM, "sdpa")
        aux = _convert(_target(OneProcessLlama, "sdpa"), draft_vocab, False) \
            .eagle_config.eagle_aux_hidden_state_layer_ids
        for batch in data:
            batch["base_model_outputs"] = _offline_outputs(base, batch, aux)
            batch["loss_mask"] = batch["attention_mask"].clone()
    return data


def _draft_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def one_process(draft_vocab: int, offline: bool):
    """ModelOpt's own training: (losses, [per-step draft gradients], the initial state)."""
    model = _convert(_target(OneProcessLlama, "sdpa"), draft_vocab, offline)
    state = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    losses, grads = [], []
    for batch in _data(draft_vocab, offline):
        opt.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append(_draft_grads(model))
        opt.step()
    return losses, grads, state


def cp_against_one_process(cases, references, strategy="ring"):
    """On every rank: each case's CP training (shard_eagle_batch + RingEagleModel, the
    ranks' gradients summed) against ModelOpt's one-process run (``references``, by
    (draft vocabulary, offline): ``one_process``'s results). Returns {case: (worst relative
    loss error, worst relative per-parameter gradient error, [CP losses])}."""
    ra_mo.register(LlamaForCausalLM)
    group = dist.group.WORLD
    out = {}
    for draft_vocab, offline, padding, teacher, tile in cases:
        ref_losses, ref_grads, state = references[(draft_vocab, offline)]
        model = _convert(_target(LlamaForCausalLM, "ringattn"), draft_vocab, offline)
        assert isinstance(model, ra_mo.RingEagleModel), type(model).__mro__
        model.load_state_dict(state)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1.0)
        loss_err, grad_err, losses = 0.0, 0.0, []
        for step, batch in enumerate(_data(draft_vocab, offline)):
            opt.zero_grad(set_to_none=True)
            local = ra_mo.shard_eagle_batch(batch, group=group, strategy=strategy)
            res = model(**local, ttt_padding=padding, teacher=teacher, tile=tile)
            # the tiles ran (no logits tensor), or ModelOpt's logits path
            assert isinstance(res.logits, ra_mo.LogitsNotComputed) == (teacher != "logits"), \
                (teacher, type(res.logits))
            res.loss.backward()
            for p in params:
                dist.all_reduce(p.grad, group=group)
            total = res.loss.detach().clone()
            dist.all_reduce(total, group=group)
            losses.append(total.item())
            loss_err = max(loss_err, abs(total.item() - ref_losses[step]) / ref_losses[step])
            got = _draft_grads(model)
            assert sorted(got) == sorted(ref_grads[step]), (sorted(got), sorted(ref_grads[step]))
            grad_err = max(grad_err, *(rel_err(got[n], ref_grads[step][n]) for n in got))
            opt.step()
        out[(draft_vocab, offline, padding, teacher, tile)] = (loss_err, grad_err, losses)
    return out


def refusals():
    """{what: the error's type and message} of each CP refusal, on this rank."""
    ra_mo.register(LlamaForCausalLM)
    model = _convert(_target(LlamaForCausalLM, "ringattn"), 64, False)
    batch = _batches()[0]
    found = {}

    def attempt(what, batch=batch, **kw):
        try:
            model(**ra_mo.shard_eagle_batch(batch), **kw)
        except (TypeError, ValueError) as exc:
            found[what] = f"{type(exc).__name__}: {exc}"
        else:
            found[what] = "no error"

    for flag, value in (("eagle_mix_hidden_states", True), ("eagle_base_lora", True),
                        ("eagle_freeze_base_model", False), ("eagle_decoder_type", "kimik2")):
        saved = getattr(model, flag)
        setattr(model, flag, value)
        try:
            attempt(flag)
        finally:
            setattr(model, flag, saved)
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    attempt("left padding", left)
    attempt("ttt_padding", ttt_padding="always")
    attempt("teacher", teacher="logit")
    attempt("tile", tile=0)
    # a hook on a head: its weights are not all it computes. "tiled" is refused by name;
    # "auto" runs ModelOpt's logits path (out.logits a tensor)
    for what, head in (("hooked draft head", model.eagle_module.lm_head),
                       ("hooked target head", model.lm_head)):
        handle = head.register_forward_hook(lambda m, a, o: o)
        try:
            attempt(what, teacher="tiled")
            out = model(**ra_mo.shard_eagle_batch(batch), teacher="auto")
            found[what + ", auto"] = type(out.logits).__name__
        finally:
            handle.remove()
    return found


@pytest.fixture(scope="module")
def cp_runs(clusters):
    """``cp_runs(W)``: every rank's ``cp_against_one_process`` results for all CASES at W
    ranks (run once per W; ModelOpt's one-process runs made once, here); with
    ``strategy``/``cases``, those."""
    references = {case[:2]: one_process(*case[:2]) for case in CASES}
    done = {}

    def run(world, strategy="ring", cases=tuple(CASES)):
        key = (world, strategy, cases)
        if key not in done:
            done[key] = clusters(world).run(cp_against_one_process, list(cases), references,
                                            strategy, timeout=200)
        return done[key]

    return run


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_cp_training_equals_modelopt_one_process(cp_runs, world, worst_errors):
    """Online and offline (base_model_outputs), draft vocabulary 64 and the full one,
    ModelOpt's masks and the masks at every step: every step's loss and every draft
    gradient on every rank equal ModelOpt's own one-process training over 5 SGD steps."""
    runs = cp_runs(world)
    for rank, results in enumerate(runs):
        for case, (loss_err, grad_err, losses) in results.items():
            print(f"W={world} rank {rank} {case}: loss {loss_err:.1e}, grads {grad_err:.1e}")
            worst_errors[("float32", "MO-l")] = (max(worst_errors.get(
                ("float32", "MO-l"), (0.0,))[0], loss_err), FP32_TOL)
            worst_errors[("float32", "MO-g")] = (max(worst_errors.get(
                ("float32", "MO-g"), (0.0,))[0], grad_err), FP32_TOL)
            assert loss_err <= FP32_TOL and grad_err <= FP32_TOL, (world, rank, case, losses)
            assert losses == runs[0][case][2], (rank, case)


@pytest.mark.timeout(120)
def test_ulysses_equals_modelopt_one_process(cp_runs):
    """The draft's TTT attention and the target's attention by Ulysses all-to-alls (W = 2,
    draft vocabulary 64): ModelOpt's one-process losses and gradients again."""
    for rank, results in enumerate(cp_runs(2, "ulysses", (CASES[0],))):
        loss_err, grad_err, _ = results[CASES[0]]
        assert loss_err <= FP32_TOL and grad_err <= FP32_TOL, (rank, loss_err, grad_err)


@pytest.mark.timeout(120)
def test_refusals_are_the_same_on_every_rank(clusters):
    """What the CP forward cannot compute exactly is refused by name, with the same error on
    every rank (before any collective: no rank hangs)."""
    found = clusters(2).run(refusals, timeout=100)
    assert found[0] == found[1], found
    names = {"eagle_mix_hidden_states": "eagle_mix_hidden_states",
             "eagle_base_lora": "eagle_base_lora", "eagle_freeze_base_model":
             "eagle_freeze_base_model", "eagle_decoder_type": "eagle_decoder_type='kimik2'",
             "left padding": "left padding", "ttt_padding": "ttt_padding='always'",
             "teacher": "teacher='logit'", "tile": "tile"}
    for what, name in names.items():
        assert found[0][what].startswith("ValueError") and name in found[0][what], found[0]
    assert "the draft's lm_head is not read as a plain linear" in found[0]["hooked draft head"]
    assert "cannot read the target's head" in found[0]["hooked target head"], found[0]
    assert found[0]["hooked draft head, auto"] == "Tensor", found[0]
    assert found[0]["hooked target head, auto"] == "Tensor", found[0]


def test_register_and_trainer_refusals():
    """register refuses a class ModelOpt already gave to its own HFEagleModel, and a
    converted model; a plain HFEagleModel or a dense mask is refused by name."""
    class Converted(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = _convert(_target(Converted, "sdpa"), 64, False)
    with pytest.raises(ValueError, match="Converted is already registered"):
        ra_mo.register(Converted)
    with pytest.raises(TypeError, match="already converted"):
        ra_mo.register(model)
    assert ra_mo.register(LlamaForCausalLM) == ra_mo.register(LlamaForCausalLM)  # idempotent
    with pytest.raises(TypeError, match="needs a RingEagleModel, got EagleConverted"):
        ra_mo.EagleRingTrainer(model=model)
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(TypeError, match="needs a TTTMask"):
        ra_mo.ttt_attention_forward(None, q, q, q, torch.zeros(1, 1, 3, 3))


def their_cp(model, batch, world):
    """ModelOpt 0.47's own CP (examples/speculative_decoding main.py with cp_size > 1:
    contiguous shards, torch's ring attention given the global TTT mask) computed in one
    process: each shard rolls its own ids and hidden states and slices its own loss rows,
    the loss is the mean of the ranks' means (FSDP averages), the draft sees no padding."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    b, s = ids.shape
    n = s // world
    base, _ = model._eagle_base_model_forward(ids, am, None, None, True, None)
    logits = model._map_logits_to_draft_vocab(base.logits)
    p, tok = torch.softmax(logits, 2).detach(), logits.argmax(-1)

    def per_shard(t, fn):
        return torch.cat([fn(c) for c in t.split(n, 1)], 1)

    emb = per_shard(base.input_embeds, lambda c: c.roll(-1, 1))
    hidden = model.eagle_module.fc(base.aux_hiddens)
    pos = torch.arange(s).expand(b, s)
    cache = transformers.DynamicCache(config=model.eagle_module.config)
    total = 0
    for j in range(model.eagle_ttt_steps):
        ok = get_ttt_msk_func(s, j)(None, None, torch.arange(s).view(1, 1, s, 1),
                                    torch.arange((j + 1) * s).view(1, 1, 1, -1))
        mask = torch.zeros(ok.shape).masked_fill(~ok, torch.finfo(torch.float32).min)
        _, out, elog, cache = model._eagle_forward(hidden, emb, mask, pos, cache)
        hidden = per_shard(out, lambda c: c.roll(1, 1))
        shares = [model._eagle_loss(pc[:, 1 + j:], tc[:, 1 + j:], ec[:, j:-1], lc[:, 1 + j:])[0]
                  for pc, tc, ec, lc in zip(p.split(n, 1), tok.split(n, 1), elog.split(n, 1),
                                            am.split(n, 1))]
        total = total + model.eagle_loss_decay_factor ** j * torch.stack(shares).mean()
    return total


@pytest.mark.timeout(240)
def test_their_cp_is_wrong_at_the_shard_boundaries(cp_runs):
    """ModelOpt's own CP at S = 12, W = 2 and 3 (draft vocabulary 64, padded rows), against its
    one-process step: the loss and the gradient differ far beyond rounding; ringattn's CP
    (the same model, W = 2 and 3, S = 13) stays at rounding. Prints both."""
    batch = _batches(seq=12, lengths=(12, 8, 10))[0]
    one = _convert(_target(OneProcessLlama, "sdpa"), 64, False)
    ref = one(**batch).loss
    params = [p for p in one.parameters() if p.requires_grad]
    ref_g = torch.cat([g.flatten() for g in torch.autograd.grad(ref, params)])
    ours = {w: cp_runs(w)[0][CASES[0]] for w in (2, 3)}
    for world in (2, 3):
        model = _convert(_target(OneProcessLlama, "sdpa"), 64, False)
        loss = their_cp(model, batch, world)
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(
            loss, [p for p in model.parameters() if p.requires_grad])])
        loss_err = abs(loss.item() - ref.item()) / ref.item()
        grad_err = rel_err(grad, ref_g)
        print(f"W={world}: ModelOpt's own CP vs one process: loss {loss_err:.1e}, gradient "
              f"{grad_err:.1e} relative; ringattn: loss {ours[world][0]:.1e}, per-parameter "
              f"gradients {ours[world][1]:.1e} (5 steps)")
        assert grad_err > 1e-2 and grad_err > 1000 * ours[world][1], (grad_err, ours[world])
        assert loss_err > 10 * ours[world][0], (loss_err, ours[world])


# ---- EagleRingTrainer under torchrun against transformers' Trainer with ModelOpt's loss ----

TRAIN_ROWS, BATCH, ACCUMULATE = 8, 2, 2


def _train_rows() -> list[dict]:
    """8 rows of S = 13, right-padded to various lengths (micro-batches with different
    token counts), what ModelOpt's collator gives (labels shifted, no loss_mask)."""
    lengths = (13, 9, 11, 13, 6, 12, 10, 13)
    rows = []
    for batch in _batches(lengths=lengths, seed=5)[:1]:
        for i in range(len(lengths)):
            rows.append({k: v[i] for k, v in batch.items()})
    return rows


def _training_args(out: str):
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, max_steps=TRAIN_ROWS // (BATCH * ACCUMULATE),
        learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        train_sampling_strategy="sequential", remove_unused_columns=False, disable_tqdm=True)


class ModelOptTrainer(transformers.Trainer):
    """ModelOpt's example trainer's loss (examples/speculative_decoding: it drops
    ``num_items_in_batch``): the one-process reference."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs)


def _draft_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


CHATS = [  # ModelOpt's online data: OpenAI-format messages, tokenized by its collator
    [{"role": "user", "content": "hello there how are you"},
     {"role": "assistant", "content": "fine thanks and you"}],
    [{"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "be brief"}, {"role": "assistant", "content": "fine"}],
    [{"role": "user", "content": "how are you"},
     {"role": "assistant", "content": "fine thanks what is two plus four"}],
] * 2
OFFLINE_LENGTHS = (13, 9, 11, 17, 6, 12, 10, 13)
"""Offline dumps of these lengths; ModelOpt's collator pads them to S = 13 and cuts 17."""


def _write_dumps(folder: Path) -> list[str]:
    """What ModelOpt's ``compute_hidden_states_*`` scripts write, one ``.pt`` per sample:
    ``input_ids`` [L], ``hidden_states`` [L, H] (post-norm) and ``aux_hidden_states``
    [L, 2H] (the aux layers' outputs) of the 2-layer target."""
    base = _target(LlamaForCausalLM, "sdpa")
    aux = _convert(_target(OneProcessLlama, "sdpa"), 64, False) \
        .eagle_config.eagle_aux_hidden_state_layer_ids
    g = torch.Generator().manual_seed(9)
    files = []
    for i, n in enumerate(OFFLINE_LENGTHS):
        ids = torch.randint(1, VOCAB, (1, n), generator=g)
        out = _offline_outputs(base, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               aux)
        files.append(str(folder / f"sample{i}.pt"))
        torch.save({"input_ids": ids[0], "hidden_states": out["base_model_hidden_states"][0],
                    "aux_hidden_states": out["aux_hidden_states"][0]}, files[-1])
    return files


def _data_paths(folder: Path) -> dict:
    """The three data paths, each (offline, dataset, collator): rows ModelOpt's collator
    would give; ModelOpt's ``OfflineSupervisedDataset`` with its ``EagleOfflineDataCollator``
    (the dumps must exist); ModelOpt's online ``LanguageDataCollator`` on chats (a
    word-level chat tokenizer, right padding to S, shifted labels)."""
    from modelopt.torch.speculative.eagle.utils import (EagleOfflineDataCollator,
                                                        OfflineSupervisedDataset)
    from modelopt.torch.utils.plugins.transformers_dataset import LanguageDataCollator

    from chat import chat_tokenizer

    files = sorted(str(f) for f in folder.glob("sample*.pt"))
    tokenizer = chat_tokenizer()
    tokenizer.padding_side = "right"
    return {
        "rows": (False, _train_rows(), None),
        "offline": (True, OfflineSupervisedDataset(files), EagleOfflineDataCollator(SEQ)),
        "online": (False, [{"messages": m} for m in CHATS],
                   LanguageDataCollator(tokenizer, train_len=SEQ, return_labels=True)),
    }


TRAINER_PATHS = ("rows", "offline")
"""The data paths the trainer test runs; "online" runs through the recipe program
(``test_modelopt_recipe_program_equals_modelopt_trainer``)."""


def _trainer_main(out: str) -> None:
    """Run by torchrun: EagleRingTrainer trains on each data path; each rank writes its
    logged losses and its draft weights."""
    import json

    torch.use_deterministic_algorithms(True)
    ra_mo.register(LlamaForCausalLM)
    import os

    rank = int(os.environ["RANK"])  # torchrun's (Trainer initialises the process group)
    for name in TRAINER_PATHS:
        offline, dataset, collator = _data_paths(Path(out))[name]
        model = _convert(_target(LlamaForCausalLM, "ringattn"), 64, offline)
        model.load_state_dict(one_process(64, offline)[2])  # ModelOpt's initial draft
        trainer = ra_mo.EagleRingTrainer(model=model, args=_training_args(f"{out}/{name}"),
                                         cp_size=None, train_dataset=dataset,
                                         data_collator=collator)
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        with open(f"{out}/losses.{name}.{rank}.json", "w") as f:
            json.dump({"losses": losses, "accs": trainer.train_accs}, f)
        torch.save(_draft_state(model), f"{out}/draft.{name}.{rank}.pt")
    dist.barrier()  # leave together: a rank tearing gloo down early can abort the other
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_eagle_ring_trainer_equals_modelopt_trainer(tmp_path):
    """EagleRingTrainer on 2 ranks (torchrun) logs the losses and reaches the draft weights
    of transformers' Trainer with ModelOpt's loss in one process: 2 SGD steps of 2
    accumulated micro-batches of 2 padded rows (ModelOpt's accumulation: the step takes the
    sum of the micro-batches' mean losses), on two data paths: rows as ModelOpt's
    collator gives them, and ModelOpt's offline dataset and collator (dumps padded and cut
    to S = 13)."""
    import json
    import os
    import subprocess

    out = tmp_path / "cp"
    out.mkdir()
    _write_dumps(out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         __file__, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    expected = {}
    for name in TRAINER_PATHS:
        offline, dataset, collator = _data_paths(out)[name]
        model = _convert(_target(OneProcessLlama, "sdpa"), 64, offline)
        start = _draft_state(model)
        ref = ModelOptTrainer(model=model, args=_training_args(str(tmp_path / "ref" / name)),
                              train_dataset=dataset, data_collator=collator)
        ref.train()
        want = [e["loss"] for e in ref.state.log_history if "loss" in e]
        assert len(want) == 2, name
        expected[name] = (want, start, _draft_state(model))
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log[-6000:]
    for name, (want, start, end) in expected.items():
        for rank in range(2):
            got = json.loads((out / f"losses.{name}.{rank}.json").read_text())
            for a, b in zip(got["losses"], want, strict=True):
                assert abs(a - b) <= FP32_TOL * abs(b), (name, rank, got["losses"], want)
            weights = torch.load(out / f"draft.{name}.{rank}.pt")
            for key in end:  # the SGD updates (lr 1): the summed gradients of both steps
                err = rel_err(weights[key] - start[key], end[key] - start[key])
                assert err <= FP32_TOL, (name, rank, key, err)


def _recipe_run(root: Path) -> tuple[list[str], Path]:
    """ModelOpt's built-in Eagle3 recipe with dotlist overrides for a tiny CPU run of the
    online path: the saved target with a chat tokenizer, the chats as JSON lines, the draft
    vocabulary's d2t (draft id i -> target id 2 i), 2 SGD steps of 2 accumulated
    micro-batches of 2 rows, S = 13. Returns (the program's arguments, the output dir)."""
    import json

    from chat import chat_tokenizer

    target = root / "target"
    _target(LlamaForCausalLM, "sdpa").save_pretrained(target)
    tokenizer = chat_tokenizer()
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(target)
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n"
                                              for m in CHATS))
    torch.save(torch.arange(64), root / "d2t.pt")
    out = root / "run"
    arch = (f"{{num_attention_heads: {HEADS}, num_key_value_heads: {KV_HEADS}, "
            f"head_dim: {HEAD_DIM}, intermediate_size: 128, draft_vocab_size: 64}}")
    overrides = [
        f"model.model_name_or_path={target}", f"data.data_path={root / 'chats.jsonl'}",
        f"data.draft_vocab_cache={root / 'd2t.pt'}", f"training.output_dir={out}",
        "training.cp_size=2", f"training.training_seq_len={SEQ}", "training.use_cpu=true",
        "training.bf16=false", "training.tf32=false", f"training.per_device_train_batch_size={BATCH}",
        f"training.gradient_accumulation_steps={ACCUMULATE}", "training.max_steps=2",
        "training.optim=sgd", "training.learning_rate=1.0", "training.warmup_steps=0",
        "training.lr_scheduler_type=constant", "training.max_grad_norm=0.0",
        "training.logging_steps=1", "training.save_strategy='no'", "training.report_to=[]",
        "training.disable_tqdm=true", "training.train_sampling_strategy=sequential",
        "training.dataloader_drop_last=false", "eagle.eagle_use_torch_compile=false",
        f"eagle.eagle_architecture_config={arch}"]
    return ["--config", "general/speculative_decoding/eagle3", *overrides], out


@pytest.mark.timeout(300)
def test_modelopt_recipe_program_equals_modelopt_trainer(tmp_path):
    """``python -m ringattn.apps.modelopt_train`` on ModelOpt's own Eagle3 recipe (2 torchrun
    ranks, training.cp_size=2, online chats through ModelOpt's LanguageDataCollator) logs
    the losses and saves the draft of transformers' Trainer with ModelOpt's loss in one
    process on the same data. A recipe it does not run exits 2 with one line naming the
    field, and ``--export`` of a draft the servers cannot read (two aux layers) before
    training."""
    import json
    import os
    import subprocess

    from safetensors.torch import load_file

    argv, out = _recipe_run(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ringattn.apps.modelopt_train", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _, dataset, collator = _data_paths(tmp_path)["online"]
    torch.manual_seed(42)  # TrainingArguments' seed: the program initialises the draft so
    model = OneProcessLlama.from_pretrained(tmp_path / "target", attn_implementation="sdpa")
    mtsp.convert(model, [("eagle", _eagle_config(64, False))])
    model.eagle_module.rotary_emb = LlamaRotaryEmbedding(config=model.eagle_module.config)
    model.eagle_module.d2t.copy_(torch.arange(64))
    ref = ModelOptTrainer(model=model.train(), args=_training_args(str(tmp_path / "ref")),
                          train_dataset=dataset, data_collator=collator)
    ref.train()
    want = [e["loss"] for e in ref.state.log_history if "loss" in e]
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log[-6000:]
    state = json.loads((out / "trainer_state.json").read_text())
    got = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert abs(a - b) <= FP32_TOL * abs(b), (got, want)
    saved = load_file(out / "model.safetensors")
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(saved[name], p.detach()) <= FP32_TOL, name
    # a 2-layer target has two aux layers, which the servers' Eagle3 cannot read
    bad = subprocess.run([sys.executable, "-m", "ringattn.apps.modelopt_train", "--export",
                          str(tmp_path / "export"), *argv, "training.cp_size=1",
                          f"training.output_dir={tmp_path / 'refused'}"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--export" in bad.stderr, bad.stderr[-3000:]
    assert not (tmp_path / "refused").exists()
    bad = subprocess.run([sys.executable, "-m", "ringattn.apps.modelopt_train", *argv,
                          "training.cp_size=1", "training.estimate_ar=true",
                          "model.use_fake_base_for_offline=true"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2, bad.stderr[-3000:]
    ours = [line for line in bad.stderr.splitlines()  # (ModelOpt warns on import)
            if line.startswith("python -m ringattn.apps.modelopt_train")]
    assert len(ours) == 1 and "use_fake_base_for_offline" in ours[0] \
        and "estimate_ar" in ours[0], bad.stderr[-3000:]


# ---- the export: what vLLM and SGLang serve from ModelOpt's draft ---------------------

SERVE_LAYERS = 7
"""The smallest target for which ModelOpt's default aux layers are three distinct ids."""


def _served_case(input_norm_scale: float):
    """A converted 7-layer target whose draft's weights are all moved off their
    initialisation (as training moves them) except, with ``input_norm_scale`` 0, the
    ``input_layernorm`` weight."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=SERVE_LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    model = _convert(LlamaForCausalLM(cfg).float(), 64, False).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.eagle_module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "input_layernorm" in name:
                p.copy_(1 + input_norm_scale * noise)
            elif "norm" in name:
                p.copy_(1 + 0.5 * noise)
            else:
                p.add_(0.05 * noise)
    return model


@torch.no_grad()
def _proposals(model, draft, prompt: torch.Tensor, k: int = 3, double_norm: bool = False):
    """(ModelOpt's ``pseudo_speculative_generate`` proposals and step-0 draft logits, the
    served draft's (``ringattn.eagle3.evaluate.draft_chain``) for the same prompt)."""
    from ringattn.eagle3 import evaluate

    base_token, theirs = model.pseudo_speculative_generate(prompt, steps=k)
    keep = []
    hooks = [model.model.layers[i].register_forward_hook(lambda m, a, o: keep.append(o))
             for i in model.eagle_config.eagle_aux_hidden_state_layer_ids]
    try:
        LlamaForCausalLM.forward(model, input_ids=prompt)
    finally:
        for h in hooks:
            h.remove()
        model.pop_and_gather_aux_hiddens()
    aux = torch.cat(keep, dim=-1)
    ids = torch.cat([prompt[:, 1:], base_token], dim=-1)
    mask = model._prepare_decoder_attention_mask(None, ids.shape, 0, aux.device, aux.dtype)
    _, _, their_logits, _ = model._eagle_forward(model.eagle_module.fc(aux),
                                                 model._base_model_embeddings(ids), mask, None)
    original = draft.hidden_norm.forward
    if double_norm:  # ModelOpt's attention input, emulated on the served draft
        draft.hidden_norm.forward = lambda h: original(draft.input_layernorm(h))
    try:
        ours, our_logits = evaluate.draft_chain(draft, torch.cat([prompt, base_token], 1), aux, k)
    finally:
        draft.hidden_norm.forward = original
    return theirs[0].tolist(), their_logits[0, -1], ours, our_logits[0]


PROMPTS = [torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(i))
           for i in range(4)]


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_served_draft_is_modelopts_draft_but_for_its_double_norm(scale):
    """ModelOpt feeds its draft's attention hidden_norm(input_layernorm(h)); the servers
    (``served_draft``) hidden_norm(h). With that double normalisation emulated on the served
    draft, its step-0 logits equal ModelOpt's to 1e-5 and it proposes ModelOpt's tokens (the
    export carries every weight, the draft vocabulary, the aux layers and the RoPE); without
    it they differ: through RMSNorm's epsilon while input_layernorm's weight is one, by far
    more once training moves it."""
    model = _served_case(scale)
    draft = ra_mo.served_draft(model).eval()
    assert draft.aux_layers == tuple(model.eagle_config.eagle_aux_hidden_state_layer_ids)
    assert len(set(draft.aux_layers)) == 3
    worst = 0.0
    for prompt in PROMPTS:
        theirs, their_logits, ours, emulated = _proposals(model, draft, prompt, double_norm=True)
        assert theirs == ours
        assert rel_err(emulated, their_logits) <= FP32_TOL
        _, _, _, served = _proposals(model, draft, prompt)
        worst = max(worst, rel_err(served, their_logits))
    print(f"\ninput_layernorm weight 1 + {scale} N(0, 1): served vs ModelOpt's step-0 "
          f"logits, worst relative error {worst:.2g}")
    assert worst > (0.05 if scale else 1e-5), worst


def test_export_draft_round_trips_and_reads_modelopts_own_export(tmp_path):
    """``export_draft`` writes both formats (warning about the double norm), and they, like
    ModelOpt's own export (d2t only, "layers.0." names), read back as ``served_draft``."""
    from ringattn.eagle3 import load_draft

    model = _served_case(0.5)
    mine = ra_mo.served_draft(model).state_dict()
    with torch.no_grad():
        model.get_exporter().export(tmp_path / "modelopt")
    for name in ("modelopt", "speculators", "sglang"):
        if name != "modelopt":
            with pytest.warns(UserWarning, match="hidden_norm\\(input_layernorm"):
                ra_mo.export_draft(model, tmp_path / name, name)
        back = load_draft(tmp_path / name,
                          embed_tokens=model.get_input_embeddings().weight).state_dict()
        for key, t in mine.items():
            if name == "modelopt" and "rotary" in key:
                continue  # ModelOpt's own export writes YaRN RoPE (factor 32) by default
            assert torch.equal(back[key], t), (name, key)
    with pytest.raises(TypeError, match="HFEagleModel"):
        ra_mo.served_draft(_target(LlamaForCausalLM, "sdpa"))

if __name__ == "__main__":
    _trainer_main(sys.argv[1])
