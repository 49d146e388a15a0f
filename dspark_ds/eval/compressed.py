"""Exact rollback of DeepSeek-V4's compressed attention after a verification round (one row).

DeepSeek-V4's compressed-sparse and heavily-compressed layers (transformers'
`DeepseekV4CSACache` / `DeepseekV4HCACache`, which it marks not croppable) keep, per layer:

- a sliding window of K = V entries that drops its oldest ones as a forward appends: after a
  verification forward over M + 1 tokens, the keys a rejected draft pushed out are gone;
- a compressor: a buffer of the projected tokens since the last closed window, the compressed
  entries emitted so far (one every `compress_rate` tokens, appended), their count, and, in the
  compressed-sparse layers, the overlap of the last window, for the compressor and for the
  indexer's own compressor. An entry closed during verification may hold rejected drafts.

None of it is cut by a crop; all of it is put back exactly by snapshot and replay:

1. Before the verification forward, each such layer's state is noted. Nothing is copied: the
   layer replaces its tensors by concatenation and slicing and never writes into them, so the
   references are the state. A forward pre-hook records each compressed layer's attention
   inputs (the normed hidden states of the M + 1 verified tokens, their RoPE and positions).
2. After the verdict, when drafts were rejected, each layer's state is restored and its
   attention runs again on the first kept inputs (its output unused): its sliding window and
   its compressors take exactly the kept tokens. The inputs at the kept positions are those of
   the verification forward (causal), so no MLP, no other layer and no lm_head runs again.

The compressor's window positions and entry count are one per layer for all rows of a cache:
rows at different positions cannot share one (`needs_row_caches`). Batched decoding gives each
row in flight a cache of its own and runs the target row by row (eval/row_caches.py); each
row's forward is recorded apart (`take`) and rolled back apart (`replay`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from dspark_ds.drafters.common.target_config import text_config
from dspark_ds.errors import ConfigError

# Text model_types whose compressed attention keeps one compressor position for all rows.
COMPRESSED_FAMILIES = ("deepseek_v4",)
# The per-layer dicts a compressed layer keeps ({"compressor": ..., "indexer": ...}).
_STATE_DICTS = (
    "buffer_kv",
    "buffer_gate",
    "compressed_kv",
    "entry_count",
    "overlap_kv",
    "overlap_gate",
)


def is_compressed_layer(layer) -> bool:
    """A DeepSeek-V4 compressed cache layer (its compressor's entries and their count)."""
    return hasattr(layer, "compressed_kv") and hasattr(layer, "entry_count")


def needs_row_caches(config) -> bool:
    """Whether rows at different positions cannot share one cache of a target with this config
    (batched decoding then gives each row its own: eval/row_caches.py)."""
    return str(getattr(text_config(config), "model_type", None)) in COMPRESSED_FAMILIES


def _note(layer) -> dict:
    state = {
        "keys": layer.keys,
        "values": layer.values,
        "cumulative_length": layer.cumulative_length,
        "is_initialized": layer.is_initialized,
    }
    for name in _STATE_DICTS:
        if hasattr(layer, name):
            state[name] = dict(getattr(layer, name))
    return state


def _restore(layer, state: dict) -> None:
    for name, value in state.items():
        setattr(layer, name, dict(value) if isinstance(value, dict) else value)


class RecordedInputs(ABC):
    """Forward pre-hooks on some of a target's modules (by layer index) that hand each one's
    input to `_record` during `recording`, after `_note` saw the cache: what a rollback
    replays (this module's `CompressedState`, recurrent.py's `RecurrentState`)."""

    def __init__(self, modules: dict[int, nn.Module]):
        self._recording = False
        for layer_idx, module in modules.items():
            module.register_forward_pre_hook(self._hook(layer_idx), with_kwargs=True)

    def _hook(self, layer_idx: int):
        def record(_module, args, kwargs):
            if self._recording:
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                self._record(layer_idx, hidden, kwargs)

        return record

    @abstractmethod
    def _note(self, cache) -> None: ...

    @abstractmethod
    def _record(self, layer_idx: int, hidden: torch.Tensor, kwargs: dict) -> None: ...

    @contextmanager
    def recording(self, cache):
        """`_note` the cache's state, then record the hooked modules' inputs during the forward
        run inside the block."""
        self._note(cache)
        self._recording = True
        try:
            yield
        finally:
            self._recording = False


@dataclass
class Recording:
    """One recorded forward: each compressed layer's state before it, and its attention's
    inputs during it (by layer index)."""

    noted: dict[int, dict]
    inputs: dict[int, dict]


class CompressedState(RecordedInputs):
    """Snapshot, record and replay of DeepSeek-V4's compressed layers (module docstring).

    Built once per target (its hooks stay registered), from `for_target`."""

    def __init__(self, attentions: dict[int, nn.Module]):
        self.attentions = attentions
        self._noted: dict[int, dict] | None = None
        self._inputs: dict[int, dict] = {}
        super().__init__(attentions)

    @classmethod
    def for_target(cls, target) -> CompressedState:
        existing = getattr(target, "_dspark_ds_compressed_state", None)
        if existing is not None:
            return existing
        attentions = {
            int(module.layer_idx): module
            for module in target.modules()
            if getattr(module, "compressor", None) is not None
            and isinstance(getattr(module, "layer_idx", None), int)
        }
        if not attentions:
            raise ConfigError("deepseek_v4: found no compressed attention layer in the target")
        state = cls(attentions)
        target._dspark_ds_compressed_state = state
        return state

    def _note(self, cache) -> None:
        """The compressed layers' states (their attention inputs are recorded next)."""
        self._noted = {i: _note(cache.layers[i]) for i in self.attentions}
        self._inputs = {}

    def _record(self, layer_idx: int, hidden: torch.Tensor, kwargs: dict) -> None:
        self._inputs[layer_idx] = dict(kwargs, hidden_states=hidden)

    def discard(self) -> None:
        self._noted = None
        self._inputs = {}

    def take(self) -> Recording | None:
        """The last recorded forward's noted states and attention inputs, handed over (None:
        nothing recorded): what `replay` puts back once the verdict is known."""
        recording = None if self._noted is None else Recording(self._noted, self._inputs)
        self.discard()
        return recording

    def rollback(self, cache, keep_R: list[int], appended: int) -> None:
        """The state after the first keep_R[0] tokens of the last recorded forward (one row)."""
        recording = self.take()
        if len(keep_R) != 1:
            raise RuntimeError("a compressed attention cache rolls back one row at a time")
        self.replay(cache, recording, int(keep_R[0]), appended)

    @torch.no_grad()
    def replay(self, cache, recording: Recording | None, keep: int, appended: int) -> None:
        """`cache` (one row) as it was after the first `keep` of the `appended` tokens of the
        forward `recording` was taken from: restored, then the kept inputs replayed."""
        if keep == appended:
            return
        if recording is None:
            raise RuntimeError(
                "rollback of a compressed attention cache without a recorded forward"
            )
        noted, inputs = recording.noted, recording.inputs
        for i, attention in self.attentions.items():
            _restore(cache.layers[i], noted[i])
            if keep == 0:
                continue
            recorded = inputs[i]
            rope = {
                name: (cos[:, :keep], sin[:, :keep])
                for name, (cos, sin) in recorded["position_embeddings"].items()
            }
            attention(
                hidden_states=recorded["hidden_states"][:, :keep],
                position_embeddings=rope,
                position_ids=recorded["position_ids"][:, :keep],
                attention_mask=None,  # (the output is not used: only the cache's updates)
                cache=cache,
            )
