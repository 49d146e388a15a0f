"""What a served target taps, and how one of its hidden-state files becomes training features.

vLLM's ``extract_hidden_states`` method stores, for every prompt token, the residual stream at the
*auxiliary layer ids* its speculative config names (``eagle_aux_hidden_state_layer_ids``), and a KV
connector writes them as one safetensors file per request: ``hidden_states [T, k, H]`` (the ids in
ascending order) and ``token_ids [T]``. vLLM numbers those states by the layer they enter:

    vLLM aux id 0      the embedding output (the input of layer 0)
    vLLM aux id j + 1  the output of decoder layer j (hidden + residual, before the final norm)
    vLLM aux id L      the output of the last layer, *before* the final norm

Our tap ids (``target.layer_ids``, the feature contract of `dspark_ds.target`) follow Hugging
Face's ``hidden_states``: ``-1`` is the embedding output, ``i`` the output of layer ``i``, except
that ``L - 1`` is the *normed* final state, and ``target_last_hidden_states`` is that normed state
too. So our ``i`` asks the server for ``i + 1``, and the final norm is applied here, on the
trainer's side, to the state vLLM calls ``L`` (`ServedLayout.features`). The trainer reads the
norm's weights from the target's files (`dspark_ds.target.target_final_norm`).

No torch.distributed, no deepspeed: `dspark-ds serve-target` imports this module too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FORMAT = "dspark-hidden-states/1"
"""The ``format`` metadata our connector writes (`serve/vllm_connector`); stock connectors
write none."""


@dataclass(frozen=True)
class ServedLayout:
    """The aux ids a server must tap for ``layer_ids`` of a target with ``num_layers`` layers, and
    where each of our features sits in the file."""

    layer_ids: tuple[int, ...]
    """Our tap ids, in the drafter's order (``target.layer_ids``)."""
    num_layers: int
    """The target's decoder layers, L."""

    @property
    def aux_ids(self) -> list[int]:
        """vLLM's ``eagle_aux_hidden_state_layer_ids``: ascending, each once, always with ``L``
        (the last hidden state the loss needs)."""
        return sorted({i + 1 for i in self.layer_ids} | {self.num_layers})

    def column(self, our_id: int) -> int:
        """The index along the file's ``k`` axis of our tap id (the pre-norm state for L - 1)."""
        return self.aux_ids.index(our_id + 1)

    def features(
        self, hidden: torch.Tensor, final_norm: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, k, H]`` of one file → (``target_hidden_states [T, n·H]``,
        ``target_last_hidden_states [T, H]``), the feature contract; ``final_norm`` is the
        target's own norm (computed in float32, returned in ``hidden``'s dtype)."""
        last_raw = hidden[:, self.column(self.num_layers - 1)]
        last = final_norm(last_raw.float()).to(hidden.dtype)
        parts = [
            last if i == self.num_layers - 1 else hidden[:, self.column(i)] for i in self.layer_ids
        ]
        return torch.cat(parts, dim=-1), last


def speculative_config(layout: ServedLayout) -> dict:
    """vLLM's ``--speculative-config`` for a server that only extracts hidden states."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layout.aux_ids}},
    }
