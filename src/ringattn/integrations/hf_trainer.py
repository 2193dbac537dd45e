"""A transformers ``Trainer`` that trains under context parallelism with ring attention.

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

What it changes, and why:

* Every rank must see the SAME batch (CP splits one sequence, not the batch), so the
  training dataloader is not sharded across processes: all ranks read the same batches in
  the same (seeded) order.
* ``compute_loss`` shards each batch with ``ringattn.shard_batch`` (labels shifted
  globally, global target count) and runs the model on this rank's shard. Its loss is the
  rank's share of the global mean; Trainer wraps the model in DDP over the same ranks,
  which AVERAGES gradients, so the loss is multiplied by the world size (the shares'
  gradients must be summed). Trainer's logged loss (the mean over ranks of that value) is
  then the global loss, and gradient clipping sees the full gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import Trainer

from ..batch import shard_batch


class RingTrainer(Trainer):
    """``Trainer`` for causal LMs with ``attn_implementation="ringattn"`` (see module doc).

    Arguments (besides Trainer's):
        layout: "zigzag" (per document for packed batches), "contiguous" or "striped".
    """

    def __init__(self, *args, layout: str = "zigzag", **kwargs):
        super().__init__(*args, **kwargs)
        self.layout = layout

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("RingTrainer: training requires a train_dataset")
        g = torch.Generator().manual_seed(self.args.seed)  # the same order on every rank
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, shuffle=True,
                          generator=g, collate_fn=self.data_collator, drop_last=True)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        local = shard_batch(batch, layout=self.layout)
        outputs = model(**local, use_cache=False)
        world = dist.get_world_size() if dist.is_initialized() else 1
        loss = outputs.loss * world
        return (loss, outputs) if return_outputs else loss
