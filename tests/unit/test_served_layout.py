"""The served target's layer numbering (`dspark_ds.serve.hidden_states`): what a vLLM server is
asked to tap, and its file turned into the feature contract, against the in-job target.

vLLM's aux id ``j`` is the residual stream entering layer ``j`` (``L``: leaving the last layer,
before the final norm). The file is rebuilt here from the Hugging Face model's own layer inputs
and outputs (hooks), the way vLLM's forward collects them, and must give `FrozenTarget`'s
features.
"""

from __future__ import annotations

import pytest
import torch

from dspark_ds.serve.hidden_states import ServedLayout, speculative_config
from dspark_ds.target import FrozenTarget, target_final_norm


def test_aux_ids_add_one_and_always_hold_the_last_layer():
    layout = ServedLayout((-1, 1, 3), 4)
    assert layout.aux_ids == [0, 2, 4]  # L - 1 asks for L, which the last state needs anyway
    assert ServedLayout((0, 2), 4).aux_ids == [1, 3, 4]
    assert ServedLayout((2, 0), 4).aux_ids == [1, 3, 4]  # ascending, as vLLM returns them
    assert [ServedLayout((2, 0), 4).column(i) for i in (2, 0, 3)] == [1, 0, 2]
    spec = speculative_config(ServedLayout((0, 2), 4))
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def _vllm_like_file(model, ids: torch.Tensor, aux_ids: list[int]) -> torch.Tensor:
    """[T, k, H]: the stream entering each layer in ``aux_ids`` (and leaving the last one)."""
    layers = model.model.layers
    stream: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs, j=j: stream.__setitem__(
                j, (args or [kwargs["hidden_states"]])[0]
            ),
            with_kwargs=True,
        )
        for j, layer in enumerate(layers)
    ]
    hooks.append(
        layers[-1].register_forward_hook(
            lambda _m, _i, out: stream.__setitem__(
                len(layers), out[0] if isinstance(out, tuple) else out
            )
        )
    )
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([stream[j][0] for j in aux_ids], dim=1)


@pytest.mark.parametrize("layer_ids", [[-1, 1, 3], [0, 2], [1, 2, 3]])
def test_file_features_equal_the_in_job_targets(tiny_target, layer_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    layout = ServedLayout(tuple(layer_ids), num_layers)
    ids = torch.arange(3, 40).remainder(model.config.vocab_size).unsqueeze(0)
    hidden = _vllm_like_file(model, ids, layout.aux_ids)
    assert hidden.shape == (ids.shape[1], len(layout.aux_ids), model.config.hidden_size)

    features, last = layout.features(hidden, target_final_norm(tiny_target))

    want, want_last = FrozenTarget(model, layer_ids)(ids)
    torch.testing.assert_close(features, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, want_last[0], rtol=1e-5, atol=1e-5)


def test_the_final_norm_is_the_targets_own(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    norm = target_final_norm(tiny_target)
    assert not any(p.requires_grad for p in norm.parameters())
    x = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(norm(x), model.model.norm(x))
