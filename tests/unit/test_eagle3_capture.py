"""The auxiliary hidden states are what vLLM and SGLang feed the draft: the RAW output of
decoder layer i (``hidden_states + residual`` after the layer, before the final norm), for
every target depth, in training (``run_target``), offline outputs (``precompute``) and
evaluation (``speculative_generate``'s target forward).

The reference runs the decoder layers one by one, as the servers' capture loops do, and
keeps each layer's output: no hook, no ``output_hidden_states``. Same model, same float32
operations, but the model builds its causal mask and positions by its own path, so the two
agree to float32 rounding (rtol 1e-5; the normed state they must NOT equal differs by O(1))."""

import pytest
import torch

from ringattn.eagle3 import aux_layer_ids, run_target
from ringattn.eagle3.draft import capture_aux_hidden, check_aux_layers
from ringattn.eagle3.evaluate import _target_forward
from ringattn.eagle3.target import OfflineSamples, precompute


def _target(layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval().requires_grad_(False)


@torch.no_grad()
def _layer_outputs(model, ids_BS: torch.Tensor) -> list[torch.Tensor]:
    """Every decoder layer's output, layer by layer (the servers' loop: embed, then each
    layer on the previous one's output; the final norm is never applied here)."""
    inner = model.model
    hidden = inner.embed_tokens(ids_BS)
    s = ids_BS.shape[1]
    pos = torch.arange(s)[None].expand(ids_BS.shape[0], -1)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]  # eager attention's additive mask
    rope = inner.rotary_emb(hidden, pos)
    outs = []
    for layer in inner.layers:
        hidden = layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        outs.append(hidden)
    return outs


TOL = dict(rtol=1e-5, atol=1e-6)


def _layers_for(n: int) -> tuple[int, ...]:
    """``aux_layer_ids`` where it is defined (n >= 3); for 2 layers both outputs, the last
    twice (capture takes any indices; only export needs three distinct ones)."""
    return aux_layer_ids(n) if n >= 3 else (0, 1, 1)


@pytest.fixture(scope="module")
def deep():
    """One 40-layer target; each depth n takes its first n layers (building 39 models would
    cost seconds each). One thread: tiny matrices, and other tests share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _target(40)
    torch.set_num_threads(threads)


def _first_layers(model, n: int):
    """``model`` cut to its first ``n`` decoder layers (a shallow copy sharing weights)."""
    import copy

    def shallow(module):
        twin = copy.copy(module)
        twin._modules = dict(module._modules)  # else the twin's submodules are the original's
        return twin

    cut = shallow(model)
    cut.model = shallow(model.model)
    cut.model.layers = torch.nn.ModuleList(list(model.model.layers)[:n])
    cut.config = cut.model.config = copy.deepcopy(model.config)
    cut.config.num_hidden_layers = n
    return cut


@pytest.mark.parametrize("n", range(2, 41))
def test_captured_states_are_the_raw_layer_outputs(deep, n):
    model = _first_layers(deep, n)
    ids = torch.randint(32, (2, 11), generator=torch.Generator().manual_seed(n))
    layers = _layers_for(n)
    ref = torch.cat([_layer_outputs(model, ids)[i] for i in layers], dim=-1)
    _, aux = capture_aux_hidden(model, layers, input_ids=ids, use_cache=False)
    torch.testing.assert_close(aux, ref, **TOL)
    got = run_target(model, {"input_ids": ids}, aux_layers=layers).aux_hidden  # training
    torch.testing.assert_close(got, ref, **TOL)
    _, got = _target_forward(model, ids[:1], layers)  # evaluation
    torch.testing.assert_close(got, ref[:1], **TOL)


def test_offline_outputs_store_the_raw_layer_outputs(tmp_path):
    model = _target(3)
    model.eagle3_aux_layers = aux_layer_ids(3)  # (0, 1, 2): the last layer's output too
    ids = torch.randint(32, (9,), generator=torch.Generator().manual_seed(1))
    precompute(model, [{"input_ids": ids, "loss_mask": torch.ones(9)}], str(tmp_path),
               dtype="float32")
    stored = OfflineSamples(str(tmp_path)).batch([0], 9)["aux_hidden"]
    ref = torch.cat(_layer_outputs(model, ids[None]), dim=-1)
    torch.testing.assert_close(stored, ref, **TOL)
    # transformers' last hidden state is after the final norm: not what servers feed the draft
    normed = model(input_ids=ids[None], output_hidden_states=True).hidden_states[3]
    assert (normed - ref[..., -16:]).norm() > 0.5 * ref[..., -16:].norm()


def test_bad_aux_layers_are_refused():
    model = _target(4)
    with pytest.raises(ValueError, match=r"outside the target's 4 decoder layers"):
        capture_aux_hidden(model, (0, 1, 4), input_ids=torch.zeros(1, 3, dtype=torch.long))
    for bad in ((2, 1, 3), (1, 1, 2), (0, 1), (-1, 0, 1)):
        with pytest.raises(ValueError, match="strictly ascending"):
            check_aux_layers(bad, 4)
