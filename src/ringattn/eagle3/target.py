"""The Eagle3 target: loaded from a local directory, or replaced by its precomputed outputs.

Legend: S sequence length, H target hidden size, V target vocabulary.

Online training runs the frozen target on every batch (``run_target``; under CP through the
transformers integration, which this library does not import: the integration, once
imported, hands ``load_target`` its loader of "ringattn" targets, ``register_loader``).
Offline training reads what the target would have produced from
disk, written once by ``precompute`` (``python -m ringattn.apps.eagle3_target``), in this format
(version 3; ``OfflineSamples`` reads versions 3 and 2):

* ``<dir>/index.json``: ``{"format": "ringattn-eagle3-offline", "version": 3,
  "aux_layers": [l0, l1, l2], "target_hidden_size": H, "vocab_size": V, "dtype": "...",
  "head": {"file": "head.safetensors", "family": model_type, "row": [field, value] or [],
  "bias": true or false}, "samples": [{"file": "sample-000000.safetensors", "length": S_i},
  ...]}``;
* ``<dir>/head.safetensors``, once per directory: the target's output head, ``weight``
  [V, H] (and ``bias`` [V] where it has one), in ``dtype``. ``row`` is the head table's row
  the family applies to the head's input or output (the config field it reads and its
  value: a soft cap, a scale; [] for none), from which ``teacher.rebuild_transforms``
  rebuilds the transforms without the model (through the transformers integration's table);
* one safetensors file per sample: ``input_ids`` [S_i] int64, ``loss_mask`` [S_i] uint8,
  ``aux_hidden`` [S_i, 3H] (the raw outputs of decoder layers ``aux_layers``, before the
  final norm, concatenated: ``capture_aux_hidden``) and ``final_hidden`` [S_i, H] (the
  target's last hidden states, after its final norm: what its head reads), in ``dtype``.

The teacher is computed from ``final_hidden`` and the head a tile of rows at a time, as
online (``teacher.py``): 4H values per token (16 KB in bf16 at H = 2048, and 9 bytes of
ids and loss mask) and the head once, instead of the V logits per token version 2 stored
(256 KB per token at a 128K vocabulary in bf16). ``precompute`` checks, per sample, that the target's logits at
one kept position equal the head's output on its final hidden state there, bit for bit.
Version 2 (written by ``precompute(..., teacher="logits")``, or for a target whose head
the table cannot read) has no ``head`` and stores ``logits`` [S_i, V] in place of
``final_hidden``; version 1 (the last layer after the final norm) is refused.
"""

from __future__ import annotations

import json
import os
from functools import cached_property

import torch

from .draft import aux_layer_ids, check_aux_layers, decoder_layers, run_target
from .teacher import TeacherHead, rebuild_transforms, teacher_head

__all__ = ["load_target", "precompute", "OfflineSamples", "FORMAT", "register_loader"]

FORMAT = "ringattn-eagle3-offline"
VERSION = 3
"""Version 1 stored ``output_hidden_states[i + 1]``, which for the last layer is after the
final norm; version 2 stores every layer's raw output (what servers feed the draft) and the
logits; version 3 the final hidden states and the head in place of the logits."""
READABLE = (2, 3)
"""The versions ``OfflineSamples`` reads."""
HEAD = "head.safetensors"
_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16"}
"""Our dtype names -> safetensors' (the header's)."""
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
def precompute(target, samples, out_dir: str, *, dtype: str = "bfloat16",
               teacher: str = "auto") -> dict:
    """Run ``target`` (one process, ``run_target``) on every sample and write the offline
    format (the module's docstring).

    Arguments:
        target: from ``load_target`` (any attention implementation).
        samples: an iterable of dicts with ``input_ids`` [S_i] and ``loss_mask`` [S_i].
        out_dir: created if missing; files are overwritten.
        dtype: of the stored hidden states, head and logits.
        teacher: "tiled": version 3 (the final hidden states and the head; the target's
            head read by ``teacher.teacher_head``, so the transformers integration must be
            imported); "logits": version 2 (the [S_i, V] logits); "auto": version 3 where
            the target's head can be read, else version 2.

    Returns:
        The index (also written to ``index.json``).

    Raises:
        ValueError: a bad ``dtype`` or ``teacher``; with "tiled", a head the table cannot
            read, or logits at the kept position that are not the head's output (named).
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if teacher not in ("auto", "tiled", "logits"):
        raise ValueError(f"teacher must be 'auto', 'tiled' or 'logits', got {teacher!r}")
    head = None
    if teacher != "logits":
        try:
            head = teacher_head(target)[0]
        except ValueError:
            if teacher == "tiled":
                raise
    store = _DTYPES[dtype]
    os.makedirs(out_dir, exist_ok=True)
    layers = getattr(target, "eagle3_aux_layers", None) or aux_layer_ids(
        target.config.num_hidden_layers)
    index = {"format": FORMAT, "version": 2 if head is None else VERSION,
             "aux_layers": list(layers), "target_hidden_size": int(target.config.hidden_size),
             "vocab_size": int(target.config.vocab_size), "dtype": dtype}
    head_file = os.path.join(out_dir, HEAD)
    if head is None:
        if os.path.exists(head_file):  # a version 3 directory's, now stale
            os.remove(head_file)
    else:
        index["head"] = {"file": HEAD, "family": head.family, "row": list(head.row),
                         "bias": head.bias is not None}
        tensors = {"weight": head.weight.to(store, copy=True).contiguous()}
        if head.bias is not None:
            tensors["bias"] = head.bias.to(store, copy=True).contiguous()
        save_file(tensors, head_file)
    entries = []
    for i, sample in enumerate(samples):
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long).reshape(-1)
        out = run_target(target, {"input_ids": ids[None]}, aux_layers=layers,
                         teacher="logits" if head is None else "tiled")
        name = f"sample-{i:06d}.safetensors"
        tensors = {"input_ids": ids.contiguous(),
                   "loss_mask": torch.as_tensor(sample["loss_mask"]).reshape(-1).to(torch.uint8),
                   "aux_hidden": out.aux_hidden[0].to(store).contiguous()}
        if head is None:
            tensors["logits"] = out.logits[0].to(store).contiguous()
        else:
            tensors["final_hidden"] = out.final_hidden[0].to(store).contiguous()
        save_file(tensors, os.path.join(out_dir, name))
        entries.append({"file": name, "length": int(ids.numel())})
    index["samples"] = entries
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return index


class OfflineSamples:
    """The samples ``precompute`` wrote (versions 3 and 2): ``len``, ``head`` (version 3:
    the target's ``TeacherHead``, read once, in the stored dtype; version 2: None) and
    ``batch(indices, seqlen)`` -> a batch for ``shard_target_outputs`` (rows right padded
    or cut to ``seqlen``, fp32 tensors): ``input_ids``, ``attention_mask``, ``loss_mask``,
    ``aux_hidden`` and, version 3, ``final_hidden`` and ``head``; version 2, ``logits``.

    Every file's header is checked when the directory is opened (its tensors are read by
    ``batch``).

    Raises:
        ValueError: a directory without an index of this format, of another version, a
            missing sample file, or a file whose tensors disagree with ``index.json`` (the
            names, shapes and dtypes its version stores: a version 2 sample in a version 3
            directory, a head of another vocabulary or width), naming the file and tensor.
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
        self.version = self.index.get("version")
        if self.version == 1:
            raise ValueError(f"{file} is version 1, which stored the last layer after the "
                             f"final norm (servers do not feed the draft that): run "
                             f"precompute again")
        if self.version not in READABLE:
            raise ValueError(f"{file} is version {self.version!r}; this library reads "
                             f"versions {READABLE}")
        if self.index.get("dtype") not in _DTYPES:
            raise ValueError(f"{file}: dtype {self.index.get('dtype')!r} is not one of "
                             f"{sorted(_DTYPES)}")
        self.path = str(path)
        idx = self.index
        h, v, dtype = idx["target_hidden_size"], idx["vocab_size"], idx["dtype"]
        teach = ("final_hidden", "H", h) if self.version == 3 else ("logits", "V", v)
        for entry in idx["samples"]:
            n = entry["length"]
            self._check(entry["file"], {
                "input_ids": ([n], "I64", "int64"), "loss_mask": ([n], "U8", "uint8"),
                "aux_hidden": ([n, 3 * h], _DTYPE_NAMES[dtype], dtype),
                teach[0]: ([n, teach[2]], _DTYPE_NAMES[dtype], dtype)},
                "sample", f"[length={n}], [length, 3H={3 * h}], [length, {teach[1]}={teach[2]}]")
        head = idx.get("head")
        if self.version == 2:
            if os.path.exists(os.path.join(self.path, HEAD)):
                raise ValueError(f"{os.path.join(self.path, HEAD)} lies in a version 2 "
                                 f"directory (a version 3 precompute's head: mixed versions); "
                                 f"run precompute again into an empty directory")
            return
        if not isinstance(head, dict) or head.get("file") != HEAD or "row" not in head:
            raise ValueError(f"{file}: a version 3 index describes its head ({{'file': "
                             f"{HEAD!r}, 'family', 'row', 'bias'}}), got head={head!r}")
        want = {"weight": ([v, h], _DTYPE_NAMES[dtype], dtype)}
        if head.get("bias"):
            want["bias"] = ([v], _DTYPE_NAMES[dtype], dtype)
        self._check(HEAD, want, "head", f"[vocab_size={v}, target_hidden_size={h}], [vocab_size]")
        self._transforms = rebuild_transforms(head["family"], head["row"])

    def _check(self, name: str, want: dict, what: str, shapes: str) -> None:
        """Raises ValueError unless file ``name`` holds exactly the tensors ``want``
        ({tensor: (shape, safetensors dtype, our dtype)})."""
        from safetensors import safe_open

        where = os.path.join(self.path, name)
        if not os.path.isfile(where):
            raise ValueError(f"offline file {name!r} is missing from {self.path!r}")
        with safe_open(where, "pt") as f:
            held = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                    for k in f.keys()}
        version = f"a version {self.version} directory's"
        for key in held.keys() - want.keys():
            other = " (a version 2 sample: mixed versions; run precompute again into an "                     "empty directory)" if key == "logits" else ""
            raise ValueError(f"{where} holds {key!r}, which {version} {what} files do "
                             f"not{other}")
        for key, (shape, kind, dtype) in want.items():
            if key not in held:
                other = " (mixed versions; run precompute again into an empty directory)"                     if key in ("final_hidden", "logits") else ""
                raise ValueError(f"{where} has no {key!r}, which {version} {what} files "
                                 f"hold{other}")
            if held[key] != (shape, kind):
                raise ValueError(f"{where}: {key!r} is {held[key][1]} {held[key][0]}, but "
                                 f"index.json says {kind} {shape} ({shapes}; {dtype})")

    @cached_property
    def head(self) -> TeacherHead | None:
        """The target's ``TeacherHead`` (version 3; read on first use), or None."""
        if self.version != 3:
            return None
        from safetensors.torch import load_file

        info = self.index["head"]
        tensors = load_file(os.path.join(self.path, HEAD))
        return TeacherHead(tensors["weight"], tensors.get("bias"), *self._transforms,
                           info["family"], tuple(info["row"]))

    def __len__(self) -> int:
        return len(self.index["samples"])

    def batch(self, indices, seqlen: int) -> dict:
        from safetensors.torch import load_file

        rows = [load_file(os.path.join(self.path, self.index["samples"][i]["file"]))
                for i in indices]
        b = len(rows)
        h = self.index["target_hidden_size"]
        teach, width = (("final_hidden", h) if self.version == 3
                        else ("logits", self.index["vocab_size"]))
        out = {"input_ids": torch.zeros(b, seqlen, dtype=torch.long),
               "attention_mask": torch.zeros(b, seqlen, dtype=torch.long),
               "loss_mask": torch.zeros(b, seqlen, dtype=torch.long),
               "aux_hidden": torch.zeros(b, seqlen, 3 * h),
               teach: torch.zeros(b, seqlen, width)}
        for r, row in enumerate(rows):
            n = min(seqlen, row["input_ids"].numel())
            out["input_ids"][r, :n] = row["input_ids"][:n]
            out["attention_mask"][r, :n] = 1
            out["loss_mask"][r, :n] = row["loss_mask"][:n].long()
            out["aux_hidden"][r, :n] = row["aux_hidden"][:n].float()
            out[teach][r, :n] = row[teach][:n].float()
        if self.version == 3:
            out["head"] = self.head
        return out


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
