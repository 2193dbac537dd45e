"""``python -m ringattn.apps.modelopt_train --config RECIPE [key=value ...]``: ModelOpt's
Eagle3 training recipe (the YAML its ``examples/speculative_decoding/main.py`` reads) under
ringattn's context parallelism (``ringattn.integrations.modelopt``; docs/modelopt.md). Run one
process per rank:

    hf download meta-llama/Llama-3.2-1B-Instruct --local-dir models/llama-3.2-1b
    torchrun --nproc-per-node 8 -m ringattn.apps.modelopt_train \\
        --config general/speculative_decoding/eagle3 \\
        model.model_name_or_path=models/llama-3.2-1b \\
        training.output_dir=ckpts/llama-eagle3 training.cp_size=8

The recipe is ModelOpt's own (``modelopt.recipe.load_recipe``: a built-in name or a file,
with dotlist overrides), read by ModelOpt's own schema; what changes against main.py is that
the target's attention is ring attention and the trainer ``EagleRingTrainer``, with
``training.cp_size`` ranks per context-parallel group (the other ranks data-parallel,
DDP). ModelOpt's own data classes read the data: its ``LanguageDataCollator`` online
(``data.data_path``, a JSON lines file of chats), its ``OfflineSupervisedDataset`` and
``EagleOfflineDataCollator`` offline (``data.offline_data_path``, a folder of ``.pt``
dumps). Checkpoints are ModelOpt's; the run resumes from the last one in
``training.output_dir``. ``--export DIR`` also writes the trained draft for vLLM
(``ra_mo.export_draft``, speculators format).

Refused with one line (exit status 2), before training: a ``model.model_name_or_path``
that is not a local model directory (a hub name: download it first, as above; every
program reads models from disk), a recipe that is not Eagle,
streaming or VLM data, ``use_fake_base_for_offline``, ``training.dp_shard_size`` other than
the data-parallel size (FSDP sharding is not done here: the replicas are DDP),
``training.estimate_ar`` or ``ar_validate_steps > 0`` (ModelOpt's AR validation runs on
CUDA in its example's callback), and what ``EagleRingTrainer`` refuses.
"""

from __future__ import annotations

import glob
import os
import sys

from . import Parser, check_model_dir, require_extra

PROG = "python -m ringattn.apps.modelopt_train"
SPEC_FIELDS = ("training_seq_len", "estimate_ar", "ar_validate_steps", "answer_only_loss",
               "cp_size", "dp_shard_size")
"""ModelOpt's extensions of ``TrainingArguments`` in the recipe's ``training`` section."""


class RecipeError(ValueError):
    """A recipe this program does not run (the message names the field)."""


def parser() -> Parser:
    p = Parser(prog=PROG, description=(
        "Train an Eagle3 draft from a ModelOpt speculative-decoding recipe with "
        "ringattn's context parallelism (exact: the losses and gradients of ModelOpt's "
        "one-process training). Start one process per rank with torchrun."))
    p.add_argument("--config", required=True,
                   help="ModelOpt's recipe: a built-in name (general/speculative_decoding/"
                        "eagle3) or a YAML file")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="also write the trained draft for vLLM (speculators format) into DIR")
    p.add_argument("overrides", nargs="*",
                   help="ModelOpt's dotlist overrides, e.g. training.cp_size=4")
    return p


def load(config: str, overrides: list[str], world: int):
    """ModelOpt's recipe, checked for what this program runs.

    Returns:
        (the recipe, transformers ``TrainingArguments`` from its training section).

    Raises:
        RecipeError: naming the field this program does not run.
    """
    from modelopt.recipe import load_recipe
    from modelopt.recipe.config import ModelOptEagleRecipe
    from transformers import TrainingArguments

    try:
        recipe = load_recipe(config, overrides=overrides)
    except (ValueError, FileNotFoundError) as exc:  # pydantic's errors are ValueErrors
        raise RecipeError(f"{config}: {exc}".replace("\n", " ")) from None
    if not isinstance(recipe, ModelOptEagleRecipe):
        raise RecipeError(f"{config} is a {type(recipe).__name__}; this program trains Eagle "
                          f"recipes (metadata.recipe_type: speculative_eagle)")
    data, training, model = recipe.data, recipe.training, recipe.model
    try:  # transformers would read a missing path or a hub name on every rank: a traceback
        check_model_dir(model.model_name_or_path, "model.model_name_or_path")
    except ValueError as exc:
        raise RecipeError(f"{config}: {exc}") from None
    cp = training.cp_size
    if cp < 1 or world % cp:
        raise RecipeError(f"training.cp_size={cp} must divide the world size {world}")
    checks = [
        (data.mode == "streaming", "data.streaming_server_url (streaming data)"),
        (data.vlm_processor is not None or data.vlm_img_dir is not None, "data.vlm_* (VLM data)"),
        (model.use_fake_base_for_offline, "model.use_fake_base_for_offline"),
        (training.dp_shard_size not in (None, world // cp),
         f"training.dp_shard_size={training.dp_shard_size} (the replicas are DDP: "
         f"{world // cp} of them)"),
        (training.estimate_ar or training.ar_validate_steps > 0,
         "training.estimate_ar / ar_validate_steps > 0 (set ar_validate_steps=-1)"),
        (data.mode == "online" and not data.data_path, "data.data_path (none given)"),
        (data.mode == "offline" and not glob.glob(os.path.join(data.offline_data_path, "*.pt")),
         f"data.offline_data_path={data.offline_data_path!r} (no .pt dumps in it)"),
    ]
    bad = [what for failed, what in checks if failed]
    if bad:
        raise RecipeError(f"{config}: not run by {PROG}: {'; '.join(bad)}")
    fields = {k: v for k, v in training.model_dump().items() if k not in SPEC_FIELDS}
    try:
        args = TrainingArguments(**fields)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"{config}: training: {exc}") from None
    return recipe, args


def build(recipe, seed: int):
    """(the converted model with ring attention, its tokenizer, the train dataset, the
    collator), as main.py builds them, with ModelOpt's own classes; the draft initialised
    under ``torch.manual_seed(seed)`` (the training arguments' seed)."""
    import modelopt.torch.opt as mto
    import modelopt.torch.speculative as mtsp
    import torch
    from modelopt.torch.speculative.eagle.utils import (EagleOfflineDataCollator,
                                                        OfflineSupervisedDataset)
    from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel
    from modelopt.torch.utils.plugins.transformers_dataset import (LanguageDataCollator,
                                                                   ShardedDataset)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..integrations import modelopt as ra_mo

    mto.enable_huggingface_checkpointing()  # checkpoints carry modelopt_state, as main.py's
    path, remote = recipe.model.model_name_or_path, recipe.model.trust_remote_code
    seq = recipe.training.training_seq_len
    config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    ra_mo.register(cls)
    model = cls.from_pretrained(path, attn_implementation="ringattn", dtype="auto",
                                trust_remote_code=remote)
    tokenizer = AutoTokenizer.from_pretrained(path, model_max_length=seq,
                                              trust_remote_code=remote)
    torch.manual_seed(seed)
    mtsp.convert(model, [("eagle", recipe.eagle.model_dump())])
    HFEagleModel.load_draft_vocab_cache(model, recipe.data.draft_vocab_cache)
    data, answer_only = recipe.data, recipe.training.answer_only_loss
    if data.mode == "offline":
        files = sorted(glob.glob(os.path.join(data.offline_data_path, "*.pt")))
        if data.sample_size > 0:
            files = files[:data.sample_size]
        dataset = OfflineSupervisedDataset(files, answer_only_loss=answer_only,
                                           tokenizer=tokenizer)
        collator = EagleOfflineDataCollator(train_len=seq)
    else:  # every rank reads the whole file: EagleRingTrainer gives each its rows
        dataset = ShardedDataset("json", data_files=data.data_path)
        if data.sample_size > 0:
            dataset = [dataset[i] for i in range(min(data.sample_size, len(dataset)))]
        collator = LanguageDataCollator(tokenizer, train_len=seq,
                                        chat_template=data.chat_template,
                                        answer_only_loss=answer_only, return_labels=True)
    return model, tokenizer, dataset, collator


def main(argv=None) -> int:
    """Train from ``--config`` with the overrides; returns 0 when training ends (a refused
    recipe exits with status 2 and one line, the same on every rank)."""
    args = parser().parse_args(argv)
    require_extra("modelopt", PROG)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        recipe, targs = load(args.config, args.overrides, world)
    except RecipeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from transformers.trainer_utils import get_last_checkpoint

    from ..integrations import modelopt as ra_mo

    model, tokenizer, dataset, collator = build(recipe, targs.seed)
    if args.export:  # the servers' Eagle3 reads three aux layers: refuse before training
        from ..eagle3.draft import check_aux_layers

        try:
            check_aux_layers(tuple(model.eagle_config.eagle_aux_hidden_state_layer_ids))
        except ValueError as exc:
            print(f"{PROG}: --export: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    trainer = ra_mo.EagleRingTrainer(model=model, processing_class=tokenizer, args=targs,
                                     train_dataset=dataset, data_collator=collator,
                                     cp_size=recipe.training.cp_size)
    last = get_last_checkpoint(targs.output_dir) if os.path.isdir(targs.output_dir) else None
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint or last)
    trainer.save_state()
    trainer.save_model(targs.output_dir)
    if args.export and trainer.is_world_process_zero():
        ra_mo.export_draft(model, args.export, "speculators",
                           target=recipe.model.model_name_or_path)
    import torch.distributed as dist

    if dist.is_initialized():
        # once, at program exit, not in any attention call's path: a rank tearing gloo down
        # while another is still in its last collective aborts that rank ("terminate called
        # without an active exception", seen in a fresh-clone make test)
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
