"""A transformers ``Trainer`` that trains under context parallelism with ring attention.

Legend: B batch, S global seq, L local seq, V vocabulary, W world size.

Launch with torchrun, one process per context-parallel rank (the whole world is one CP
group here), e.g. ``torchrun --nproc-per-node 4 train.py`` on CPU ranks (``use_cpu=True``)
or GPUs:

    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.hf_trainer import RingTrainer
    ra_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ringattn")
    trainer = RingTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                          data_collator=collator, layout="zigzag")
    trainer.train()

The contract: logged losses, gradients (so every step), ``evaluate`` metrics and
``predict`` outputs equal a plain ``Trainer`` in ONE process on the same data with the same
arguments, up to floating-point rounding. What it changes, and why:

* Every rank must see the SAME batches (CP splits one sequence, not the batch). Training,
  evaluation and test loaders are accelerate loaders prepared for one process
  (``num_processes=1``): the order a one-process Trainer uses (accelerate's seedable
  sampler, seeded by ``data_seed`` or ``seed`` and re-seeded per epoch, so
  ``resume_from_checkpoint`` replays the same order), on every rank.
  ``train_sampling_strategy`` must be "random" or "sequential" (the length-grouped
  samplers draw from rank-local state).
* ``get_batch_samples`` shards each micro-batch with ``ringattn.shard_batch`` (labels
  shifted on the global sequence) and counts the targets of ALL the micro-batches of the
  optimizer step, as Trainer counts ``num_items_in_batch`` in one process. ``compute_loss``
  divides this rank's summed token losses by that count: the ranks' losses add up to the
  mean over every target of the accumulated batch (``loss_is_scaled_for_ga = True``, so
  Trainer does not divide by the accumulation steps again). DDP averages gradients over
  the W ranks, so the loss is multiplied by W (the shares' gradients must be summed);
  Trainer's logged loss (the mean over ranks of that value, summed over micro-batches) is
  then the global loss, and gradient clipping sees the full gradient.
* ``prediction_step`` sums the ranks' shares of each batch's loss over the CP group, and
  gathers the logits of the whole sequence with ``ringattn.unshard`` ([B, S, V] on every
  rank: O(S V) memory per rank, what ``predict`` returns anyway). Every rank then holds the
  one-process results, so ``evaluation_loop`` gathers nothing across ranks; the last batch
  is cut as accelerate cuts it in one process.
* ``evaluate``/``predict`` before ``train`` leave the model ready for DDP (see the shim in
  ``evaluation_loop``).
* ``bf16``/``fp16`` need nothing here: accelerate's autocast wraps the model's forward and
  ring attention runs q, k, v in the autocast dtype as SDPA does.

Refused, loudly: ``compute_loss_func`` and ``label_smoothing_factor`` (Trainer would apply
them to the local shard's logits with a local normalisation), other sampling strategies,
and the ``parallelism_config`` layouts listed below.

dp x cp: ``RingTrainer(..., cp_size=c)`` arranges the W ranks as a (W / c) x c mesh and
trains with DDP over all of them: each dp replica reads its rows of every global batch
(what one process with ``per_device_train_batch_size x W / c`` rows reads), its c ranks
shard them with ring attention, the target count is summed over the replicas, and
the loss is scaled by W as above (tested: dp 2 x cp 2 on 4 CPU ranks equals one process
with 4-row batches).

parallelism_config: ``TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=D,
cp_size=C))`` (accelerate's ``ParallelismConfig``; D x C = W, torchrun with W processes)
trains dp_shard x cp with FSDP2: the parameters sharded by ``fully_shard`` over the
config's flattened "dp_shard_cp" mesh dimension (all W ranks, as torchtitan does), ring
attention over "cp", each of the D dp_shard replicas reading its rows as with ``cp_size``
above. RingTrainer takes the config over from accelerate, because accelerate cannot run it
on CPU ranks. What was run (transformers 5.24, accelerate 1.15, torch 2.13, torchrun with 4
gloo CPU ranks, a plain ``Trainer`` and ``ParallelismConfig(cp_size=2, dp_shard_size=2)``):
with ``use_cpu=True``, ``Trainer.__init__`` raises "ParallelismConfig is only compatible
DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or
DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU", also with
``fsdp="full_shard", fsdp_config={"fsdp_version": 2}`` and with ``ACCELERATE_USE_FSDP=true
FSDP_VERSION=2`` in the environment (``AcceleratorState`` switches to FSDP only in its
multi-accelerator branch); without ``use_cpu`` it raises "ParallelismConfig total_size (4)
does not match num_processes (1)". accelerate's own ParallelismConfig tests
(tests/test_dataclasses.py) run on CPU with ``init_device_mesh`` mocked, and its FSDP2
tests are marked ``require_non_cpu``/``require_multi_device``: nothing there runs this mesh
with FSDP2 on CPU processes. So:

* ``_build_accelerator_args`` gives accelerate no ``parallelism_config`` (it sets up the
  distributed state it sets up without one), and RingTrainer builds the config's mesh with
  the config's own ``get_device_mesh`` (accelerate's ``build_device_mesh``: dims
  ("dp_shard", "cp"), flattened "dp_shard_cp", "dp", "dp_cp"), cached on the config.
* ``_shard_parameters``: ``fully_shard`` over mesh["dp_shard_cp"] on each layer class of
  the model's ``_no_split_modules``, then on the root; the trainer then takes the model as
  Trainer takes one sharded at load time (``is_distributed_loading_by_transformers``):
  accelerate adds autocast but no DDP, the optimizer gets the sharded parameters, and with
  gradient accumulation the reduce-scatter waits for the last micro-batch
  (``_defer_fsdp_gradient_reduction``).
* The loss scaling is unchanged: FSDP2's reduce-scatter over dp_shard_cp averages over all
  W ranks, as DDP does, so the loss is multiplied by W as above.
* Trainer's torch-CP input path (``_prepare_context_parallel_inputs``, sdpa only) is inert:
  RingTrainer shards every batch itself.
* ``save_model`` (and ``save_only_model=True`` checkpoints) gathers the full weights
  (``full_tensor``) on every rank and the main process writes them. Checkpoints to resume
  from are refused (``save_strategy`` other than "no" needs ``save_only_model=True``): the
  optimizer state is sharded and Trainer would save rank 0's shard only.
* Refused with a ValueError naming the values, on every rank: tp_size, sp_size or
  dp_replicate_size above 1, cp_size 1, ``RingTrainer(cp_size=)`` different from the
  config's, a total size other than the world size, ``TrainingArguments(fsdp=...)`` or
  accelerate's FSDP plugin too.

Tested (tests/integration/test_trainer_parallelism.py, gloo CPU ranks, fp32): D=2 x C=2 on
4 ranks (also with gradient accumulation 2 and clipping) and C=3 on 3 ranks, S=37 (not a
multiple of 2C), padded rows: every logged loss and gradient norm, train_loss, eval loss
(also before training), ``predict``'s logits, every parameter's gradient at every optimizer
step (gathered with ``full_tensor``), the weights after training and those ``save_model``
and a ``save_only_model`` checkpoint wrote equal a one-process ``Trainer`` reading the D
replicas' rows, within 1e-5 relative (measured: 3.1e-6 at worst, a gradient);
test_trainer.py runs ``ParallelismConfig(cp_size=2)`` on 2 ranks. Not tested: GPUs (the
same code builds an nccl mesh), bf16 under FSDP2, strategies other than "ring" with a
``parallelism_config``. FSDP2 over a dp x cp mesh with ring attention, without Trainer:
tests/integration/test_fsdp_cp.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from transformers import Trainer

from ...validate import check_strategy
from ...batch import shard_batch
from ...comm import hybrid_mesh
from ...layouts import DEFAULT_LAYOUT
from ...loss import DEFAULT_TILE, check_loss_tile
from ...sharding import unshard
from ..transformers import check_attention, check_model, tiled_call

_SAMPLING = ("random", "sequential")


def _is_hf_dataset(dataset) -> bool:
    import datasets

    return isinstance(dataset, datasets.Dataset)


__all__ = ["RingTrainer", "RingTrainerMixin"]

class RingTrainerMixin:
    """Context parallelism for a ``Trainer`` or a subclass of one: put it first among the
    bases, ``class MyTrainer(RingTrainerMixin, SomeTrainer)``. ``RingTrainer`` is
    ``RingTrainerMixin`` over transformers' ``Trainer``.

    Arguments (besides the trainer's):
        layout: "zigzag" (per document for packed batches), "contiguous" or "striped".
        strategy: "auto", "ring", "ulysses", "allgather" or "hybrid" (docs/strategies.md).
        ulysses_size: with strategy "hybrid", ranks of the Ulysses dimension (consecutive
            ranks of each CP group; the ring goes across them).
        cp_size: ranks per context-parallel group; None: the whole world. With W ranks and
            ``cp_size`` c, the ranks form a (W / c) x c mesh ("dp", "cp"): each dp replica
            reads its own rows of every global batch of ``per_device_train_batch_size x
            W / c`` rows (the rows one process would read with that batch size), its c ranks
            shard them along the sequence, and DDP averages over all W ranks (gradients
            and the logged loss equal one process with the global batch). Evaluation and
            prediction run the whole eval set on every dp replica (redundant, exact).
            With ``TrainingArguments(parallelism_config=...)``, None or the config's
            cp_size (the config then gives the mesh, and FSDP2 shards the parameters).
        loss_tile: the training loss is computed from the decoder's hidden states in tiles
            (``ringattn.tiled_lm_loss``: never more than one tile's logits alive; the same
            loss and gradients) of this many tokens (an int), or of as many tokens as a
            budget of one tile's logits allows (a string: ``"16MiB"``, the default, is 27
            tokens at a 152k vocabulary); None: the model's own untiled loss. Families whose head the tiles cannot follow run untiled
            (``integrations.transformers.head.tile_problem``). Evaluation is untiled.

    Raises:
        ValueError: a model whose attention is not ring attention
            (``integrations.transformers.check_attention``) or that ``check_model`` refuses
            (and, at the first step, one that never called ring attention); arguments that
            give accelerate fewer processes than torch.distributed has ranks (no DDP: on
            CPU ranks without ``use_cpu=True``); ``compute_loss_func``,
            ``label_smoothing_factor`` or a
            ``train_sampling_strategy`` other than "random"/"sequential"; torch.distributed
            not initialised (launch with torchrun); a ``parallelism_config`` other than
            dp_shard x cp (D x C = W, C > 1; see the module doc).
    """

    # compute_loss divides by the targets of the whole accumulated batch (get_batch_samples)
    loss_is_scaled_for_ga = True

    def __init__(self, *args, layout: str = DEFAULT_LAYOUT, cp_size: int | None = None,
                 strategy: str = "ring", ulysses_size: int = 8,
                 loss_tile: int | str | None = DEFAULT_TILE, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tile = None if loss_tile is None else check_loss_tile(loss_tile, "loss_tile")
        if not dist.is_initialized():
            raise ValueError(f"{type(self).__name__} needs torch.distributed initialised: "
                             "launch it with torchrun, or accelerate launch with a distributed_type: MULTI_GPU "
                             "config (a MULTI_CPU config starts one process)")
        if self.compute_loss_func is not None:
            raise ValueError("RingTrainer computes the causal-LM loss itself; compute_loss_func "
                             "would see one rank's shard only")
        if self.args.label_smoothing_factor != 0:
            raise ValueError(f"RingTrainer does not support label_smoothing_factor="
                             f"{self.args.label_smoothing_factor} (it needs 0)")
        if self.args.train_sampling_strategy not in _SAMPLING:
            raise ValueError(f"RingTrainer supports train_sampling_strategy in {_SAMPLING}, got "
                             f"{self.args.train_sampling_strategy!r}")
        pc = self.args.parallelism_config
        if _ring_owns(pc):
            _check_parallelism(pc, cp_size, self.args, self.is_fsdp_enabled)
        check_attention(self.model)
        check_model(self.model)
        _check_ranks_are_processes(self.accelerator, self.args)
        self.layout, self.strategy = layout, check_strategy(strategy)
        self.device_mesh = None  # the ParallelismConfig mesh, when there is one
        if _ring_owns(pc):
            self.device_mesh = pc.get_device_mesh(torch.device(self.args.device).type)
            self.cp_group, self.dp_group, self.dp_rank, self.dp_size = _parallelism_groups(
                pc, self.device_mesh)
            self._shard_parameters(self.device_mesh["dp_shard_cp"])
        else:
            self.cp_group, self.dp_group, self.dp_rank, self.dp_size = _mesh(cp_size,
                                                                             self.args.device)
        self.attn_group = (hybrid_mesh(self.cp_group, ulysses_size) if strategy == "hybrid"
                           else self.cp_group)

    # ---- parallelism_config: the mesh and FSDP2 ---------------------------------------

    def _build_accelerator_args(self, **kwargs) -> dict:
        """Trainer's Accelerator arguments, without a ``parallelism_config`` that RingTrainer
        takes over (any dimension above 1): accelerate refuses it on CPU ranks, and on GPUs
        would shard the batch a second time with torch's CP; RingTrainer builds the mesh
        with the config's own ``build_device_mesh`` and shards the parameters itself."""
        args = super()._build_accelerator_args(**kwargs)
        if _ring_owns(self.args.parallelism_config):
            args.pop("parallelism_config", None)
        return args

    def _shard_parameters(self, mesh) -> None:
        """FSDP2 (``fully_shard``) over ``mesh`` (the flattened dp_shard x cp dimension):
        each layer class the model names in ``_no_split_modules``, then the root. Trainer then
        takes the model as one that owns its gradient reduction (its path for models sharded
        at load time): accelerate adds autocast but no DDP, the optimizer gets the sharded
        parameters, and gradient accumulation defers the reduce-scatter to the last
        micro-batch (``_defer_fsdp_gradient_reduction``)."""
        from torch.distributed.fsdp import fully_shard

        layers = set(getattr(self.model, "_no_split_modules", None) or ())
        for module in list(self.model.modules())[1:]:
            if type(module).__name__ in layers:
                fully_shard(module, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.model._is_fsdp_managed_module = True  # transformers' mark of an FSDP2 model
        self.model_wrapped = self.model
        self.is_distributed_loading_by_transformers = True

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """No reduce-scatter before the last micro-batch of an accumulated step (the model
        sharded by ``_shard_parameters``; one sharded at load time: Trainer's)."""
        if self.device_mesh is None:
            with super()._defer_fsdp_gradient_reduction():
                yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _save(self, output_dir=None, state_dict=None):
        """Trainer's ``_save`` (``save_model``, ``save_only_model`` checkpoints) of the
        sharded model: every rank gathers the full weights (``full_tensor``), the main
        process writes them."""
        if self.device_mesh is not None and state_dict is None:
            state_dict = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                          for k, v in self.model.state_dict().items()}
        return super()._save(output_dir, state_dict=state_dict)

    def get_cp_size(self) -> int:
        """The context-parallel size of a ``parallelism_config`` (Trainer's total batch size
        counts the dp replicas by it)."""
        pc = self.args.parallelism_config
        return pc.cp_size if _ring_owns(pc) else super().get_cp_size()

    def _prepare_context_parallel_inputs(self, model, inputs):
        """Inert: RingTrainer shards every batch itself (``get_batch_samples``); torch's CP
        input path (sdpa only) must not split it again."""
        return contextlib.nullcontext, inputs

    def _shard(self, inputs: dict) -> dict:
        """This rank's shard of a batch dict (``shard_batch`` over the whole world;
        non-tensor entries dropped)."""
        batch = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        return shard_batch(batch, group=self.attn_group, layout=self.layout,
                           strategy=self.strategy)

    # ---- data: the same batches on every rank ---------------------------------------

    def _same_on_every_rank(self, dataset, batch_size: int, description: str, shuffle: bool,
                            replicas: int = 1, replica: int = 0):
        """A loader giving every rank the batches a one-process Trainer would see (with
        ``replicas`` > 1: replica ``replica``'s share of each of them)."""
        from accelerate.data_loader import prepare_data_loader
        from transformers.utils import is_datasets_available

        collator = self.data_collator
        if is_datasets_available() and _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        sampler = None
        if not isinstance(dataset, IterableDataset):
            sampler = RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator,
                            drop_last=self.args.dataloader_drop_last,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        # split over the dp replicas only (the cp ranks of a replica read the same rows);
        # the seedable sampler is forced on (with a plain RandomSampler the ranks would
        # each draw their own order)
        return prepare_data_loader(loader, self.args.device, num_processes=replicas,
                                   process_index=replica, put_on_device=True,
                                   use_seedable_sampler=True, data_seed=seed)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("RingTrainer: training requires a train_dataset")
        return self._same_on_every_rank(self.train_dataset, self._train_batch_size, "Training",
                                        shuffle=self.args.train_sampling_strategy == "random",
                                        replicas=self.dp_size, replica=self.dp_rank)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("RingTrainer: evaluation requires an eval_dataset")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        return self._same_on_every_rank(eval_dataset, self.args.eval_batch_size, "Evaluation",
                                        shuffle=False)

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self._same_on_every_rank(test_dataset, self.args.eval_batch_size, "test",
                                        shuffle=False)

    # ---- training -------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches of one optimizer step, sharded, and their target count.

        Returns:
            (up to ``num_batches`` ``shard_batch`` dicts, this rank's shards of the next
            micro-batches; the number of targets in all of them, a 0-d tensor on
            ``device`` that compute_loss divides by, or None without labels).
        """
        shards = []
        for _ in range(num_batches):
            try:
                shards.append(self._shard(next(epoch_iterator)))
            except StopIteration:
                break
        counts = [s["num_items_in_batch"] for s in shards if "num_items_in_batch" in s]
        if not counts:
            return shards, None
        total = torch.stack(counts).sum().to(device)
        if self.dp_size > 1:  # the targets of every replica's rows: the global batch's
            dist.all_reduce(total, group=self.dp_group)
        return shards, total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of the loss, times W (see module doc).

        Arguments:
            inputs: a batch dict, or a shard of one from ``get_batch_samples``.
            num_items_in_batch: the targets of the whole accumulated batch (as
                ``get_batch_samples`` counts them); None: this batch's own targets.
        """
        local = inputs if "ring_context" in inputs else self._shard(inputs)
        if num_items_in_batch is not None:
            local = {**local, "num_items_in_batch": num_items_in_batch}
        call = tiled_call(self.model, local, self.loss_tile)  # None: the model's own loss
        outputs = model(**(local if call is None else call.kwargs), use_cache=False)
        local["ring_context"].check_consumed(self.model)  # named as built, not as wrapped (DDP)
        if call is not None:
            outputs = call.finish(outputs)
        loss = outputs.loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step (backward of this rank's share of the loss, times W); returns the
        global loss, the same on every rank (one all-reduce of a scalar), so that what
        Trainer accumulates, logs and reports as ``train_loss`` (including the steps after
        the last log, which Trainer adds without gathering) is the one-process value."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        total = loss.detach().clone()
        dist.all_reduce(total)  # every process's share of the accumulated batch, times W
        return total / self.accelerator.num_processes

    # ---- evaluation and prediction --------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """One evaluation batch, run sharded; what one process would return.

        Returns:
            (the batch's mean loss, 0-d, None without labels; the logits of the whole
            sequence [B, S, V], None when ``prediction_loss_only``; the labels [B, S]),
            the same on every rank.
        """
        inputs = self._prepare_inputs(inputs)
        local = self._shard(inputs)
        ctx = local["ring_context"]
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**local, use_cache=False)
        labels = inputs.get("labels")
        loss = None
        if labels is not None:
            loss = outputs.loss.detach().float()
            dist.all_reduce(loss, group=ctx.group)  # the shares of the batch's mean
        if prediction_loss_only:
            return loss, None, None
        logits = unshard(outputs.logits.detach(), group=ctx.group, layout=ctx.layout, dim=1,
                         seqlen=ctx.seqlen, cu_seqlens=ctx.cu_seqlens)
        return loss, logits, labels

    def evaluation_loop(self, *args, **kwargs):
        # Every rank already holds the one-process results: gather nothing (the loop
        # resets gather_function to accelerate's gather_for_metrics when it ends).
        self.gather_function = self._as_one_process
        unprepared = not getattr(self.model, "_is_accelerate_prepared", False)
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            if unprepared and not self.is_in_train:
                # Shim (accelerate 1.15, transformers 5.23): evaluating before training
                # prepares the model for evaluation (autocast, no DDP) and marks it
                # prepared, so train()'s accelerator.prepare returns it without DDP and
                # every rank steps on its own share of the gradient (a plain Trainer
                # under DDP has the same bug: its ranks diverge). Unmarked, train()
                # prepares it for training.
                self.model._is_accelerate_prepared = False

    def _as_one_process(self, data):
        """What ``gather_for_metrics`` returns in one process: ``data``, cut on the last
        batch to the dataset's remainder (evaluation_loop repeats each batch's loss
        eval_batch_size times, and the last batch may hold fewer rows)."""
        from accelerate.utils import recursively_apply

        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return recursively_apply(lambda t: t[: state.remainder], data)
        return data



class RingTrainer(RingTrainerMixin, Trainer):
    """transformers' ``Trainer`` for causal LMs with ``attn_implementation="ringattn"``,
    context-parallel (see the module doc and ``RingTrainerMixin`` for the arguments)."""


def _check_ranks_are_processes(accelerator, args) -> None:
    """Refuse a Trainer that did not make every torch.distributed rank one of its processes.

    Under torchrun on CPU ranks without ``use_cpu=True``, transformers 5.24 finds no GPU,
    leaves ``parallel_mode`` NOT_PARALLEL and accelerate DistributedType.NO: no DDP, so each
    rank would step on its own share of the gradient and log its own share of the loss.

    Raises:
        ValueError: accelerate counts fewer processes than the world has ranks.
    """
    world = dist.get_world_size()
    if accelerator.num_processes == world:
        return
    hint = ("these are CPU ranks: pass use_cpu=True to TrainingArguments"
            if not args.use_cpu and not torch.cuda.is_available() else
            "launch one process per rank with torchrun and let TrainingArguments set up "
            "distributed training")
    raise ValueError(
        f"RingTrainer needs DDP over the {world} ranks of torch.distributed, but "
        f"TrainingArguments set up {accelerator.num_processes} process(es) (parallel_mode "
        f"{args.parallel_mode.value}, accelerate {accelerator.distributed_type.value}): each "
        f"rank would update its weights with its own share of the gradient; {hint}")


def _ring_owns(pc) -> bool:
    """Whether RingTrainer takes over ``parallelism_config`` ``pc`` (a dimension above 1)."""
    return pc is not None and pc.total_size > 1


def _check_parallelism(pc, cp_size, args, fsdp_enabled) -> None:
    """Refuse a ``ParallelismConfig`` RingTrainer does not run: it runs dp_shard x cp.

    Raises:
        ValueError: tp_size, sp_size or dp_replicate_size above 1; cp_size 1; a ``cp_size``
            argument that differs from the config's; a total size other than the world
            size; ``TrainingArguments(fsdp=...)`` or accelerate's FSDP (``fsdp_enabled``:
            an FSDP plugin, ``ACCELERATE_USE_FSDP``; accelerate enables it only on
            accelerators) as well; checkpoints with the sharded optimizer state.
    """
    sizes = (f"dp_replicate_size={pc.dp_replicate_size}, dp_shard_size={pc.dp_shard_size}, "
             f"cp_size={pc.cp_size}, tp_size={pc.tp_size}, sp_size={pc.sp_size}")
    world = dist.get_world_size()
    unsupported = [f"{name}={size} (RingTrainer supports 1)" for name, size in
                   (("tp_size", pc.tp_size), ("sp_size", pc.sp_size),
                    ("dp_replicate_size", pc.dp_replicate_size)) if size > 1]
    if pc.cp_size < 2:
        unsupported.append(f"cp_size={pc.cp_size} (RingTrainer needs a context-parallel "
                           "dimension of 2 or more ranks)")
    if cp_size is not None and cp_size != pc.cp_size:
        unsupported.append(f"RingTrainer(cp_size={cp_size}) differs from parallelism_config "
                           f"cp_size={pc.cp_size} (give one)")
    if pc.total_size != world:
        unsupported.append(f"total size {pc.total_size} is not the world size {world}")
    if args.fsdp or fsdp_enabled:
        what = f"TrainingArguments(fsdp={args.fsdp!r})" if args.fsdp else "accelerate's FSDP"
        unsupported.append(f"{what} as well (RingTrainer shards the parameters with FSDP2 "
                           "over dp_shard x cp itself)")
    if args.save_strategy != "no" and not args.save_only_model:
        unsupported.append(f"save_strategy={args.save_strategy.value!r} without "
                           "save_only_model=True (the optimizer state is sharded; checkpoints "
                           "to resume from are not supported)")
    if unsupported:
        raise ValueError(f"RingTrainer with parallelism_config ({sizes}): "
                         + "; ".join(unsupported))


def _parallelism_groups(pc, mesh):
    """(cp group, dp group or None, dp rank, dp size) of a ``ParallelismConfig`` mesh: the
    dp replicas are the dp_shard dimension."""
    if pc.dp_shard_size == 1:
        return mesh["cp"].get_group(), None, 0, 1
    return (mesh["cp"].get_group(), mesh["dp_shard"].get_group(),
            mesh.get_local_rank("dp_shard"), pc.dp_shard_size)


def _mesh(cp_size, device):
    """(cp group, dp group or None, dp rank, dp size) for ``cp_size`` ranks per CP group.

    Raises:
        ValueError: ``cp_size`` does not divide the world size.
    """
    world = dist.get_world_size()
    if cp_size is None or cp_size == world:
        return dist.group.WORLD, None, 0, 1
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size must be a divisor of the world size {world}, got {cp_size!r}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(torch.device(device).type, (world // cp_size, cp_size),
                            mesh_dim_names=("dp", "cp"))
    return (mesh["cp"].get_group(), mesh["dp"].get_group(), mesh.get_local_rank("dp"),
            world // cp_size)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
