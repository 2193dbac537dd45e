"""Run by tests/integration/test_trainer.py: a few HF Trainer steps of a tiny Llama, either
plain in one process (``--ref``) or as RingTrainer under torchrun; every process writes the
losses it logged to ``<out>.<process index>``."""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (models.py)
from models import tiny_causal_lm  # noqa: E402


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 97, (8, 37), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import Trainer, TrainingArguments

    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.hf_trainer import RingTrainer

    targs = TrainingArguments(output_dir=str(Path(args.out).parent / "trainer"), use_cpu=True,
                              per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
                              logging_steps=1, report_to=[], save_strategy="no", seed=0,
                              lr_scheduler_type="constant", max_grad_norm=1.0,
                              disable_tqdm=True)
    if args.ref:  # plain Trainer, one process, the same batches in the same order

        class SameOrder(Trainer):
            get_train_dataloader = RingTrainer.get_train_dataloader

        trainer = SameOrder(model=tiny_causal_lm("llama", "eager"), args=targs,
                            train_dataset=Rows())
    else:
        ra_hf.register()
        model = tiny_causal_lm("llama", "ringattn")
        trainer = RingTrainer(model=model, args=targs, train_dataset=Rows(), layout="zigzag")
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(f"{args.out}.{trainer.args.process_index}").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
