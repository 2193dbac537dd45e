"""The Eagle3 target: loaded from a local directory, or replaced by its precomputed outputs.

Legend: S sequence length, H target hidden size, V target vocabulary.

Online training runs the frozen target on every batch (``run_target``; under CP through the
transformers integration, which this library does not import: the integration, once
imported, hands ``load_target`` its loader of "ringattn" targets, ``register_loader``).
Offline training reads what the target would have produced from
disk, written once by ``precompute`` (``python -m ringattn.apps.eagle3_target``), in this format:

* ``<dir>/index.json``: ``{"format": "ringattn-eagle3-offline", "version": 2,
  "aux_layers": [l0, l1, l2], "target_hidden_size": H, "vocab_size": V, "dtype": "...",
  "samples": [{"file": "sample-000000.safetensors", "length": S_i}, ...]}``;
* one safetensors file per sample: ``input_ids`` [S_i] int64, ``loss_mask`` [S_i] uint8,
  ``aux_hidden`` [S_i, 3H] (the raw outputs of decoder layers ``aux_layers``, before the
  final norm, concatenated: ``capture_aux_hidden``), ``logits`` [S_i, V] (the target's), in ``dtype``.

Logits take S x V values per sample (a 128K vocabulary in bf16 is 256 KB per token): offline
training trades that disk for not running the target again.
"""

from __future__ import annotations

import json
import os

import torch

from .draft import aux_layer_ids, capture_aux_hidden, check_aux_layers, decoder_layers

__all__ = ["load_target", "precompute", "OfflineSamples", "FORMAT", "register_loader"]

FORMAT = "ringattn-eagle3-offline"
VERSION = 2
"""Version 1 stored ``output_hidden_states[i + 1]``, which for the last layer is after the
final norm; version 2 stores every layer's raw output (what servers feed the draft)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
RING = "ringattn"
"""The attention implementation ring attention registers with transformers (the transformers
integration's ``NAME``): ``load_target``'s default."""
_LOADERS: dict = {}
"""attention implementation -> ``load(path, dtype)`` of the integration that registers it."""


def register_loader(attn_implementation: str, load) -> None:
    """Load the targets that run ``attn_implementation`` with ``load(path, dtype)`` (a torch
    dtype; returns the model): how an integration that registers an attention
    implementation with transformers gives ``load_target`` a model that runs it. The
    Eagle3 library imports no integration; ``ringattn.integrations.transformers``
    registers "ringattn" here when imported (its ``load_pretrained``: the attention
    registered, the model ``convert``-ed)."""
    _LOADERS[attn_implementation] = load


def load_target(path: str, *, dtype: str = "float32", attn_implementation: str = RING,
                aux_layers=None):
    """A frozen causal LM from a local transformers directory (``from_pretrained``), in
    eval mode, with ``eagle3_aux_layers`` set (``aux_layers`` or ``aux_layer_ids``).

    Arguments:
        path: a directory with ``config.json`` and the weights (no download is tried).
        dtype: "float32" or "bfloat16".
        attn_implementation: "ringattn" (under CP; loaded by the transformers integration,
            ``ringattn.integrations.transformers``, imported first: registered there and
            the model ``convert``-ed, so a hybrid target's sequence mixers run across
            ranks) or one of transformers' ("sdpa", "eager") for one process.

    Raises:
        ValueError: a path that is not such a directory, a bad dtype, a model ring
            attention cannot run exactly, or "ringattn" without the transformers
            integration imported.
    """
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(os.path.join(str(path), "config.json")):
        raise ValueError(f"target {path!r} is not a local transformers model directory "
                         f"(no config.json)")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    load = _LOADERS.get(attn_implementation)
    if load is None and attn_implementation == RING:
        raise ValueError(f"attn_implementation={RING!r} targets load through the transformers "
                         f"integration: import it first (from ringattn.integrations import "
                         f"transformers as ra_hf), or pass 'sdpa' or 'eager' for one process")
    if load is not None:  # the integration's: registered, then converted
        model = load(path, _DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=_DTYPES[dtype], attn_implementation=attn_implementation,
            local_files_only=True)
    n = len(decoder_layers(model))
    model.eagle3_aux_layers = check_aux_layers(aux_layers, n) if aux_layers is not None else \
        aux_layer_ids(n)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def precompute(target, samples, out_dir: str, *, dtype: str = "bfloat16") -> dict:
    """Run ``target`` (one process) on every sample and write the offline format.

    Arguments:
        target: from ``load_target`` (any attention implementation).
        samples: an iterable of dicts with ``input_ids`` [S_i] and ``loss_mask`` [S_i].
        out_dir: created if missing; files are overwritten.
        dtype: of the stored hidden states and logits.

    Returns:
        The index (also written to ``index.json``).
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    os.makedirs(out_dir, exist_ok=True)
    layers = getattr(target, "eagle3_aux_layers", None) or aux_layer_ids(
        target.config.num_hidden_layers)
    entries = []
    for i, sample in enumerate(samples):
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long).reshape(-1)
        out, aux = capture_aux_hidden(target, layers, input_ids=ids[None], use_cache=False)
        aux = aux[0]
        name = f"sample-{i:06d}.safetensors"
        save_file({"input_ids": ids.contiguous(),
                   "loss_mask": torch.as_tensor(sample["loss_mask"]).reshape(-1).to(torch.uint8),
                   "aux_hidden": aux.to(_DTYPES[dtype]).contiguous(),
                   "logits": out.logits[0].to(_DTYPES[dtype]).contiguous()},
                  os.path.join(out_dir, name))
        entries.append({"file": name, "length": int(ids.numel())})
    index = {"format": FORMAT, "version": VERSION, "aux_layers": list(layers),
             "target_hidden_size": int(target.config.hidden_size),
             "vocab_size": int(target.config.vocab_size), "dtype": dtype, "samples": entries}
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return index


class OfflineSamples:
    """The samples ``precompute`` wrote: ``len``, and ``batch(indices, seqlen)`` -> a batch
    for ``shard_target_outputs`` (rows right padded or cut to ``seqlen``, fp32 tensors).

    Raises:
        ValueError: a directory without an index of this format, or a missing sample file.
    """

    def __init__(self, path: str):
        file = os.path.join(str(path), "index.json")
        try:
            with open(file) as f:
                self.index = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path!r} holds no readable offline index ({exc})") from exc
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{file} is not a {FORMAT!r} index")
        if self.index.get("version") != VERSION:
            raise ValueError(f"{file} is version {self.index.get('version')!r}, not {VERSION} "
                             f"(version 1 stored the last layer after the final norm, which "
                             f"servers do not feed the draft): run precompute again")
        self.path = str(path)
        for entry in self.index["samples"]:
            if not os.path.isfile(os.path.join(self.path, entry["file"])):
                raise ValueError(f"offline sample {entry['file']!r} is missing from {path!r}")

    def __len__(self) -> int:
        return len(self.index["samples"])

    def batch(self, indices, seqlen: int) -> dict:
        from safetensors.torch import load_file

        rows = [load_file(os.path.join(self.path, self.index["samples"][i]["file"]))
                for i in indices]
        b = len(rows)
        width = rows[0]["aux_hidden"].shape[-1]
        vocab = rows[0]["logits"].shape[-1]
        out = {"input_ids": torch.zeros(b, seqlen, dtype=torch.long),
               "attention_mask": torch.zeros(b, seqlen, dtype=torch.long),
               "loss_mask": torch.zeros(b, seqlen, dtype=torch.long),
               "aux_hidden": torch.zeros(b, seqlen, width),
               "logits": torch.zeros(b, seqlen, vocab)}
        for r, row in enumerate(rows):
            n = min(seqlen, row["input_ids"].numel())
            out["input_ids"][r, :n] = row["input_ids"][:n]
            out["attention_mask"][r, :n] = 1
            out["loss_mask"][r, :n] = row["loss_mask"][:n].long()
            out["aux_hidden"][r, :n] = row["aux_hidden"][:n].float()
            out["logits"][r, :n] = row["logits"][:n].float()
        return out


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
