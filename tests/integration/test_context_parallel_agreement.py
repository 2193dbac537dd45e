"""``ra_hf.context_parallel`` and ``average_gradients``: what every rank must agree on, and
what must equal one process.

Each case runs on every rank of a W = 2 or 3 gloo cluster (the session's), on a fresh
process group, with ringattn's peer timeout cut to ``PEER_TIMEOUT_S`` so that a case whose
ranks fall out of step fails in seconds instead of hanging; all the cases of one W run in
ONE cluster call (``outcomes``), each caught on its own, and the tests assert on every
rank's outcome. The cases:

* the whole call is agreed: one rank passing another keyword argument (``num_items_in_batch``
  on one rank or with another value, ``output_router_logits``, ``return_dict``,
  ``max_length_q``, ``labels``) raises the same ValueError naming it on every rank, and
  the next call still equals one process;
* packed rows (position ids restarting at 0, or ``cu_seq_lens_q``), with labels = input_ids
  (one process counts the target of a document's last token in the next document) and with
  a flattening collator's labels (-100 at each document's first token): ``out.loss`` and
  every parameter gradient equal one process (float64, ``TOL``) on every rank;
* labels that give a padding token a target, or a target to one (which the ring cannot
  compute as one process does), are refused on every rank;
* a forward pre-hook registered on the model before entering sees the ``ring_context``;
* a model refused on one rank only (sdpa), or settings that differ between ranks, raise
  the same ValueError on every rank at entry;
* ``average_gradients`` with a parameter that has a gradient on some ranks and None on
  others (its tokens reached it on some ranks only) gives the one-process gradient (None
  counts as zeros; None on every rank stays None); parameter lists that differ between
  ranks raise a ValueError naming the parameter on every rank.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from models import tiny_causal_lm
from reference import rel_err

pytest.importorskip("transformers")

TOL = 1e-6
"""float64 model against the same float64 model in one process; measured about 2e-7 (loss
1e-7, gradients 2e-7; fp32 padding cases 4.4e-7): transformers' eager attention takes its
softmax in float32 even in float64. Before the fix, labels = input_ids on a packed row
differed by 2.9e-3 (loss) and 0.41 (gradients)."""
VOCAB = 97
PEER_TIMEOUT_S = 8.0
"""ringattn's peer timeout inside the cases: a case whose ranks fall out of step raises a
PeerError after this long (a failure of the case), not after the default minutes."""


def _models(sdpa: bool = False, dtype=torch.float64):
    """(ring-attention tiny Llama, the same weights with eager attention), float64 (fp32
    where one process in float64 is NaN: transformers' eager attention turns a left-padded
    row's padding into NaN values in float64, which reach the real tokens as 0 * NaN)."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    ring = tiny_causal_lm("llama", "sdpa" if sdpa else "ringattn").to(dtype)
    return ring, tiny_causal_lm("llama", "eager").to(dtype)


def _plain(seqlen: int = 29, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, seqlen), generator=g)
    return dict(input_ids=ids, labels=ids.clone())


DOCS = (0, 7, 8, 21)
"""Starts of the packed row's documents (one of a single token); the last ends at S."""


def _packed(seqlen: int, labels: str, documents: str, seed: int = 3) -> tuple[dict, dict]:
    """(the batch given to the model under context_parallel, the one-process batch): one row
    of documents. ``labels`` "input_ids" (labels = input_ids) or "collator" (-100 at every
    document's first token, as DataCollatorWithFlattening); ``documents`` "position_ids"
    (restarting at 0), "flash" (a flattening collator's flash-attention kwargs beside the
    position ids) or "cu_seq_lens" (cu_seq_lens_q/k alone). One process always gets the
    position ids (its eager attention reads the documents from them)."""
    g = torch.Generator().manual_seed(seed)
    cu = [*DOCS, seqlen]
    ids = torch.randint(1, VOCAB, (1, seqlen), generator=g)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
    lab = ids.clone()
    if labels == "collator":
        lab[0, cu[:-1]] = -100
    one = dict(input_ids=ids, labels=lab, position_ids=pos)
    if documents == "position_ids":
        return dict(one), one
    offsets = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    flash = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=longest,
                 max_length_k=longest)
    if documents == "flash":
        return dict(one, **flash), one
    return dict(input_ids=ids, labels=lab, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets), one


def _errors(out, one, model, ref) -> dict:
    """Relative errors of ``out.loss`` and of every parameter gradient against one process
    (NaN counts as inf; a gradient None in one process must be None here too)."""
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None or p.grad is None:
            worst = max(worst, 0.0 if p.grad is None and q.grad is None else float("inf"))
            continue
        err = rel_err(p.grad, q.grad)
        worst = max(worst, err if err == err else float("inf"))
    loss = rel_err(out.loss.detach(), one.loss.detach())
    return {"loss": loss if loss == loss else float("inf"), "grads": worst}


def _refused(fn):
    """(class name, message) of the TypeError/ValueError ``fn`` raised, or None."""
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


def _step(model, ref, batch, one_batch, group) -> dict:
    """One forward/backward under the (entered) manager and in one process: errors."""
    from ringattn.integrations import transformers as ra_hf

    out = model(**batch)
    out.loss.backward()
    ra_hf.average_gradients(model, group)
    one = ref(**one_batch, use_cache=False)
    one.loss.backward()
    return _errors(out, one, model, ref)


# ---- 1. the whole call is agreed ----------------------------------------------------------

def _call_differs(group, argument: str):
    """One rank's call differs in ``argument``: (refusal, errors of the next call)."""
    from ringattn.integrations import transformers as ra_hf

    rank, last = dist.get_rank(group), dist.get_world_size(group) - 1
    model, ref = _models()
    batch = _plain()
    count = int((batch["labels"][:, 1:] != -100).sum())
    call = dict(batch)
    if argument == "num_items_in_batch":  # on the last rank only
        if rank == last:
            call["num_items_in_batch"] = torch.tensor(count)
    elif argument == "num_items_in_batch value":  # everywhere, another value on rank 0
        call["num_items_in_batch"] = torch.tensor(count + (rank == 0))
    elif argument == "output_router_logits":
        if rank == 0:
            call["output_router_logits"] = True
    elif argument == "return_dict":
        if rank == last:
            call["return_dict"] = True
    elif argument == "max_length_q":
        if rank == last:
            call["max_length_q"] = 29
    elif argument == "labels":
        if rank == 0:
            call.pop("labels")
    else:
        raise AssertionError(argument)
    with ra_hf.context_parallel(model, group):
        refusal = _refused(lambda: model(**call))
        errs = _step(model, ref, batch, batch, group)  # the ranks are still in step
    return refusal, errs


# ---- 3. packed rows and labels ------------------------------------------------------------

def _packed_loss(group, labels: str, documents: str, layout: str = "zigzag"):
    from ringattn.integrations import transformers as ra_hf

    model, ref = _models()
    batch, one_batch = _packed(37, labels, documents)
    with ra_hf.context_parallel(model, group, layout=layout):
        errs = _step(model, ref, batch, one_batch, group)
    return errs


def _padding_targets(group, which: str):
    """Labels that give a padding token a target (or one to it): refused on every rank;
    then the same batch with those labels at -100 equals one process."""
    from ringattn.integrations import transformers as ra_hf

    model, ref = _models(dtype=torch.float32)
    batch = _plain(31, seed=4)
    keep = torch.ones(2, 31, dtype=torch.long)
    if which == "left":  # the padding's own labels -100, the first real token's kept
        keep[1, :6] = 0
        ids = batch["input_ids"].masked_fill(keep == 0, 0)
        labels = ids.masked_fill(keep == 0, -100)
        fixed = labels.clone()
        fixed[1, 6] = -100
    else:  # right padding, labels = input_ids (padding id 0 as a target)
        keep[0, 26:] = 0
        ids = batch["input_ids"].masked_fill(keep == 0, 0)
        labels = ids.clone()
        fixed = ids.masked_fill(keep == 0, -100)
    bad = dict(input_ids=ids, labels=labels, attention_mask=keep)
    good = dict(bad, labels=fixed)
    with ra_hf.context_parallel(model, group):
        refusal = _refused(lambda: model(**bad))
        errs = _step(model, ref, good, good, group)
    return refusal, errs


# ---- 4. hook order ------------------------------------------------------------------------

def _hook_order(group):
    """A forward pre-hook (with kwargs) registered on the model before entering sees the
    call's ring_context; the loss still equals one process."""
    from ringattn.integrations import transformers as ra_hf

    model, ref = _models()
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append("ring_context" in kwargs), with_kwargs=True)
    batch = _plain()
    try:
        with ra_hf.context_parallel(model, group):
            errs = _step(model, ref, batch, batch, group)
    finally:
        handle.remove()
    return seen, errs


# ---- 5. entry ------------------------------------------------------------------------------

def _entry(group, what: str):
    """The entry differs on one rank: (refusal at entry, errors of a context entered
    properly afterwards: the ranks are still in step)."""
    from ringattn.integrations import transformers as ra_hf

    rank = dist.get_rank(group)
    model, ref = _models()
    if what == "sdpa on rank 1":
        given = _models(sdpa=True)[0] if rank == 1 else model
        options = {}
    elif what == "layout on rank 0":
        given, options = model, {"layout": "striped" if rank == 0 else "zigzag"}
    elif what == "ignore_index on the last rank":
        last = dist.get_world_size(group) - 1
        given, options = model, {"ignore_index": -1 if rank == last else -100}
    else:
        raise AssertionError(what)

    def enter():
        with ra_hf.context_parallel(given, group, **options):
            given(**_plain())  # the others would wait here for a rank that raised

    refusal = _refused(enter)
    batch = _plain(seed=2)
    with ra_hf.context_parallel(model, group):
        errs = _step(model, ref, batch, batch, group)
    return refusal, errs


# ---- 2. average_gradients -----------------------------------------------------------------

class _Routed(torch.nn.Module):
    """Tokens below VOCAB // 2 go through ``low``, the others through ``high``; ``unused``
    is reached by no token. ``extra`` (a parameter list differing between ranks) adds one
    more parameter of that shape, used by every token."""

    def __init__(self, extra: tuple[int, ...] | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.low = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.high = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.unused = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 1, dtype=torch.float64)
        if extra is not None:
            self.extra = torch.nn.Parameter(torch.ones(extra, dtype=torch.float64))

    def forward(self, ids):
        h = self.embed(ids)
        if hasattr(self, "extra"):
            h = h * self.extra.view(-1)[:1]
        low = ids < VOCAB // 2
        out = torch.zeros_like(h)
        if bool(low.any()):
            out[low] = self.low(h[low])
        if bool((~low).any()):
            out[~low] = self.high(h[~low])
        return self.head(torch.tanh(out)).squeeze(-1)


def _routed_tokens(world: int) -> torch.Tensor:
    """[W, 6] token ids, one row per rank; rank 1's all below VOCAB // 2 (``high`` gets no
    gradient there), the others' mixed."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (world, 6), generator=g)
    ids[:, 0] = VOCAB - 1  # every other rank reaches ``high``
    ids[1] = torch.randint(0, VOCAB // 2, (6,), generator=g)
    return ids


def _grads_none_on_some_ranks(group):
    """Each rank backpropagates W times its share of the global mean (as under the manager);
    ``average_gradients`` must give the one-process gradients of the mean."""
    from ringattn.integrations import transformers as ra_hf

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ids = _routed_tokens(world)
    model, ref = _Routed(), _Routed()
    (world * model(ids[rank]).square().sum() / ids.numel()).backward()
    had = {n: p.grad is not None for n, p in model.named_parameters()}
    ra_hf.average_gradients(model, group)
    ref(ids.flatten()).square().mean().backward()
    errs = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None or p.grad is None:
            errs[name] = 0.0 if p.grad is None and q.grad is None else float("inf")
        else:
            errs[name] = rel_err(p.grad, q.grad)
    return had, errs


def _parameters_differ(group, how: str):
    from ringattn.integrations import transformers as ra_hf

    rank, last = dist.get_rank(group), dist.get_world_size(group) - 1
    if how == "an extra parameter on the last rank":
        model = _Routed(extra=(1,) if rank == last else None)
    else:  # "another shape on rank 0"
        model = _Routed(extra=(2,) if rank == 0 else (1,))
    ids = _routed_tokens(dist.get_world_size(group))
    model(ids.flatten()).sum().backward()
    return _refused(lambda: ra_hf.average_gradients(model, group))


# ---- the cases ----------------------------------------------------------------------------

CALL_ARGUMENTS = ("num_items_in_batch", "num_items_in_batch value", "output_router_logits",
                  "return_dict", "max_length_q", "labels")
PACKED = [(labels, documents) for labels in ("input_ids", "collator")
          for documents in ("position_ids", "flash", "cu_seq_lens")]
ENTRIES = ("sdpa on rank 1", "layout on rank 0", "ignore_index on the last rank")
DIFFERENT_PARAMETERS = ("an extra parameter on the last rank", "another shape on rank 0")


def _cases(world: int) -> dict:
    """{case name: (function, args)} of world size W."""
    cases = {}
    for arg in CALL_ARGUMENTS:
        cases[f"call: {arg}"] = (_call_differs, (arg,))
    for labels, documents in PACKED:
        cases[f"packed: labels={labels}, {documents}"] = (_packed_loss, (labels, documents))
    cases["packed: labels=input_ids, striped"] = (_packed_loss,
                                                  ("input_ids", "position_ids", "striped"))
    for which in ("left", "right"):
        cases[f"padding targets: {which}"] = (_padding_targets, (which,))
    cases["hook order"] = (_hook_order, ())
    for what in ENTRIES:
        cases[f"entry: {what}"] = (_entry, (what,))
    cases["average_gradients: None on some ranks"] = (_grads_none_on_some_ranks, ())
    for how in DIFFERENT_PARAMETERS:
        cases[f"average_gradients: {how}"] = (_parameters_differ, (how,))
    return cases


def run_cases(world: int) -> dict:
    """Rank side: {case: ("returned", value) or ("raised", class name, message)}, every
    case on a fresh group (a case that left a collective pending never meets the next)."""
    from ringattn import comm

    saved = comm.get_timeout()
    comm.set_timeout(PEER_TIMEOUT_S)
    results = {}
    try:
        for name, (fn, args) in _cases(world).items():
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
            failed = False
            try:
                results[name] = ("returned", fn(group, *args))
            except Exception as exc:  # the case's outcome, judged by its test
                failed = isinstance(exc, comm.PeerError) or "imeout" in str(exc)
                results[name] = ("raised", type(exc).__name__, str(exc)[:3000])
            if failed:  # its group may hold a pending operation: leave it, start afresh
                comm.clear_failure()
            else:
                dist.destroy_process_group(group)
    finally:
        comm.set_timeout(saved)
    return results


@pytest.fixture(scope="module")
def outcomes(clusters):
    """``outcomes(W)``: every rank's results of every case of world size W (run once)."""
    done: dict = {}

    def get(world: int) -> list[dict]:
        if world not in done:
            try:
                done[world] = clusters(world).run(run_cases, world, timeout=240)
            except (AssertionError, TimeoutError) as exc:  # RankFailure or a hung rank
                done[world] = exc
        if isinstance(done[world], BaseException):
            pytest.fail(f"the cases of W={world} did not finish: {done[world]}")
        return done[world]

    return get


def _returned(outcomes, world: int, case: str) -> list:
    values = []
    for rank, results in enumerate(outcomes(world)):
        got = results[case]
        assert got[0] == "returned", f"{case}, rank {rank}: {got}"
        values.append(got[1])
    return values


def _assert_exact(errs: dict, where: str) -> None:
    for name, err in errs.items():
        assert err < TOL, f"{where}: {name} relative error {err:.3e} (bound {TOL:.0e})"


WORLDS = (2, 3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("argument", CALL_ARGUMENTS)
def test_every_argument_of_the_call_is_agreed(outcomes, world, argument):
    name = argument.split()[0]
    for rank, (refusal, errs) in enumerate(_returned(outcomes, world, f"call: {argument}")):
        assert refusal is not None, f"{argument} differing between ranks ran on rank {rank}"
        cls, message = refusal
        assert cls == "ValueError" and "disagree on" in message and name in message, (
            rank, refusal)
        _assert_exact(errs, f"the next call, rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("labels,documents", PACKED + [("input_ids", "striped")])
def test_packed_rows_equal_one_process(outcomes, world, labels, documents):
    case = (f"packed: labels={labels}, {documents}" if documents != "striped"
            else "packed: labels=input_ids, striped")
    for rank, errs in enumerate(_returned(outcomes, world, case)):
        _assert_exact(errs, f"{case}, rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("which", ["left", "right"])
def test_targets_of_padding_are_refused(outcomes, world, which):
    case = f"padding targets: {which}"
    for rank, (refusal, errs) in enumerate(_returned(outcomes, world, case)):
        assert refusal is not None and refusal[0] == "ValueError", (rank, refusal)
        assert "padding" in refusal[1] and "-100" in refusal[1], (rank, refusal)
        _assert_exact(errs, f"{case} with -100 there, rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_earlier_pre_hook_sees_the_ring_context(outcomes, world):
    for rank, (seen, errs) in enumerate(_returned(outcomes, world, "hook order")):
        assert seen == [True], (rank, seen)
        _assert_exact(errs, f"rank {rank}")


ENTRY_WORDS = {"sdpa on rank 1": "rank 1: LlamaForCausalLM runs attention implementation 'sdpa'",
               "layout on rank 0": "ranks disagree on layout",
               "ignore_index on the last rank": "ranks disagree on ignore_index"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("what", ENTRIES)
def test_entry_refused_on_every_rank(outcomes, world, what):
    for rank, (refusal, errs) in enumerate(_returned(outcomes, world, f"entry: {what}")):
        assert refusal is not None and refusal[0] == "ValueError", (rank, refusal)
        assert ENTRY_WORDS[what] in refusal[1], (rank, refusal)
        _assert_exact(errs, f"a later context, rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_average_gradients_counts_none_as_zeros(outcomes, world):
    case = "average_gradients: None on some ranks"
    for rank, (had, errs) in enumerate(_returned(outcomes, world, case)):
        assert had["high.weight"] == (rank != 1) and not had["unused.weight"], (rank, had)
        _assert_exact(errs, f"rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("how", DIFFERENT_PARAMETERS)
def test_average_gradients_refuses_other_parameters(outcomes, world, how):
    case = f"average_gradients: {how}"
    for rank, refusal in enumerate(_returned(outcomes, world, case)):
        assert refusal is not None and refusal[0] == "ValueError", (rank, refusal)
        assert "extra" in refusal[1] and "average_gradients" in refusal[1], (rank, refusal)
