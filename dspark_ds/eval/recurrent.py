"""Exact rollback of a hybrid target's recurrent layers after a verification round.

Hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet; Granite-4.0-H
(granitemoehybrid), Falcon-H1: Mamba2) interleave full attention with layers that keep, per
row, a recurrent state and a convolution state instead of a KV cache. A verification forward
over `[x_start, d_1..d_M]` runs every token through those layers; a KV cache can then be cut
back to the accepted positions, but a recurrent state holds all M + 1 tokens folded in, and
the rejected drafts cannot be taken out of it.

The method: snapshot and replay, layer by layer.

1. Before the verification forward, the state of every stateful layer is copied (the recurrent
   state, and the convolution window), and a forward pre-hook records each stateful mixer's
   input (the normed hidden states of the M + 1 verified tokens).
2. After the verdict, a row that kept all M + 1 columns keeps the state the forward left.
   Every other row gets its layer states back from the snapshot, and each stateful mixer
   (`linear_attn` / `mamba` of its decoder layer, transformers' own module) runs again on the
   first keep_r recorded inputs of that row: the state is then exactly the state after the
   accepted tokens. The inputs of layer l at the kept positions are the same as in the
   verification forward (causal), so nothing but the mixers runs again: no MLP / MoE, no
   attention layer, no lm_head. Rows are replayed together per distinct kept length (one
   mixer call per layer and length).

Full-attention layers keep their KV cache rollback (`crop_cache`, the KV part of
`DynamicCache.crop`); the convolution states are replayed too. transformers 5.25 rolls a
recurrent state back itself only from a history of intermediate states that the mixers compute
when `recurrent_states_to_keep` asks for them (one state per draft, every layer, every
forward): `start_recording` asks for none and `crop_cache` cuts the linear-attention layers as
transformers 5.24 did (their convolution windows and token count, their recurrent state left to
the replay), so both versions decode the same way.

DeepSeek-V4's compressed attention keeps no recurrent state, but a compressor and a sliding
window no crop rolls back: eval/compressed.py puts them back (`rollback_state` picks either).

A target whose config or cache says it keeps a recurrent state but whose family is not one of
`STATEFUL_MIXERS` is refused by name: its state could not be put back, and decoding it would
silently not be lossless.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from dspark_ds.drafters.common.target_config import text_config
from dspark_ds.errors import ConfigError
from dspark_ds.eval.compressed import (
    COMPRESSED_FAMILIES,
    CompressedState,
    RecordedInputs,
    is_compressed_layer,
)

# Text model_type -> the decoder layer's attribute holding the stateful mixer (a module with
# `layer_idx`, called as mixer(hidden_states=..., cache=..., attention_mask=...)).
STATEFUL_MIXERS = {
    "qwen3_5_text": "linear_attn",
    "qwen3_5_moe_text": "linear_attn",
    "qwen3_next": "linear_attn",
    "granitemoehybrid": "mamba",
    "falcon_h1": "mamba",
}
# Families known to keep a recurrent state (their own cache classes, or layer types
# transformers' DynamicCache maps to linear-attention layers) that are not supported.
_RECURRENT_FAMILIES = (
    "mamba",
    "mamba2",
    "falcon_mamba",
    "jamba",
    "zamba",
    "zamba2",
    "bamba",
    "nemotron_h",
    "lfm2",
    "lfm2_moe",
    "kimi_linear",
    "olmo_hybrid",
    "rwkv",
    "recurrent_gemma",
    "xlstm",
    "minimax",
    "lfm3",
)
# Layer types that keep per-token columns only (a KV cache, which a crop rolls back): DeepSeek
# Sparse Attention's "indexed_attention" (DeepSeek-V3.2, GLM-5) caches its indexer's keys per
# token beside the MLA cache (transformers' `DynamicIndexedLayer`, whose crop cuts both).
_ATTENTION_LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "attention",
    "indexed_attention",
)


def _family(config) -> str:
    return str(getattr(text_config(config), "model_type", None) or "unknown")


def is_recurrent(config) -> bool:
    """Whether a target with this config keeps a per-row state other than a KV cache."""
    text = text_config(config)
    if _family(config) in _RECURRENT_FAMILIES or _family(config) in STATEFUL_MIXERS:
        return True
    layer_types = getattr(text, "layer_types", None) or []
    if any(
        t not in _ATTENTION_LAYER_TYPES and t not in ("dummy", "moe", "mlp") for t in layer_types
    ):
        return True
    return any(k.startswith(("mamba_", "ssm_", "linear_conv")) for k in text.to_dict())


def check_recurrent_target(config) -> None:
    """Refuse a target that keeps a recurrent state we cannot roll back exactly."""
    family = _family(config)
    if is_recurrent(config) and family not in STATEFUL_MIXERS and family not in COMPRESSED_FAMILIES:
        raise ConfigError(
            f"{family}: this target keeps a recurrent (state-space / linear-attention) state that "
            "speculative decoding cannot roll back exactly after rejected drafts, so it is "
            f"refused rather than decoded wrongly; supported hybrid families: "
            f"{', '.join(sorted(STATEFUL_MIXERS))} (docs/known-limits.md#hybrid-targets)"
        )


def rollback_state(target) -> RecurrentState | CompressedState | None:
    """What puts `target`'s per-row state other than a KV cache back after a round: its
    recurrent layers' (`RecurrentState`), DeepSeek-V4's compressed attention's
    (`CompressedState`, eval/compressed.py), or None (a KV cache alone)."""
    check_recurrent_target(target.config)
    if _family(target.config) in COMPRESSED_FAMILIES:
        return CompressedState.for_target(target)
    return RecurrentState.for_target(target)


@dataclass
class _Snapshot:
    """The stateful layers' states before a forward, and the mixers' inputs during it."""

    conv: dict[int, dict[int, torch.Tensor]]
    recurrent: dict[int, dict[int, torch.Tensor]]
    inputs: dict[int, torch.Tensor]


def _linear_layers(cache) -> dict[int, LinearAttentionCacheLayerMixin]:
    return {
        i: layer
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    }


def start_recording(cache) -> None:
    """Past recording on: sliding-window layers keep what a rejected draft must be cut out of,
    linear-attention layers their whole convolution windows until `crop_cache`; no intermediate
    recurrent states (transformers >= 5.25's `recurrent_states_to_keep`: the replay rebuilds
    a kept state)."""
    if "recurrent_states_to_keep" in _recording_params():
        cache.activate_past_recording(recurrent_states_to_keep=0)
    else:
        cache.activate_past_recording()


@functools.cache
def _recording_params() -> frozenset[str]:
    method = LinearAttentionCacheLayerMixin.activate_past_recording
    return frozenset(inspect.signature(method).parameters)


def crop_cache(cache, tokens_to_remove: int) -> None:
    """`cache.crop(-tokens_to_remove)` (0 still trims sliding windows and convolution windows),
    with each linear-attention part cut as transformers 5.24 cut it: its convolution windows
    and its token count, its recurrent state left as it is for `RecurrentState.rollback` (5.25's
    own crop takes it from a history that `start_recording` does not keep)."""
    for layer in cache.layers:
        if is_compressed_layer(layer):
            continue  # (no crop: CompressedState.rollback restores and replays it)
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.crop(-tokens_to_remove)
            continue
        _crop_linear(layer, tokens_to_remove)
        kv_crop = _kv_crop(type(layer))  # a layer with attention beside its mixer (Falcon-H1)
        if kv_crop is not None:
            kv_crop(layer, -tokens_to_remove)


@functools.cache
def _kv_crop(layer_class: type):
    for klass in layer_class.__mro__:
        if "crop" in vars(klass) and not issubclass(klass, LinearAttentionCacheLayerMixin):
            return klass.crop
    return None


def _crop_linear(layer, n: int) -> None:
    for s in range(layer.number_of_states):
        if layer.is_conv_states_initialized[s]:
            conv, width = layer.conv_states[s], layer.conv_kernel_size[s]
            layer.conv_states[s] = conv[..., -width:] if n == 0 else conv[..., -n - width : -n]
    _drop_history(layer)
    count = getattr(layer, "cumulative_length_linear", None)
    if count is not None:
        count.sub_(n)


def _drop_history(layer) -> None:
    """transformers >= 5.25 keeps, under past recording, the recurrent state each forward and
    each replay started from (until its own crop): nothing here reads them."""
    history = getattr(layer, "recurrent_states_history", None)
    if history is not None:
        for s in history:
            history[s] = []


def _counts(cache) -> dict[int, int]:
    """The token count of each linear-attention layer (transformers >= 5.25 keeps one)."""
    return {
        i: int(layer.cumulative_length_linear)
        for i, layer in _linear_layers(cache).items()
        if getattr(layer, "cumulative_length_linear", None) is not None
    }


def _pad_conv_windows(cache) -> None:
    """Left-pad convolution windows shorter than the kernel (a prompt shorter than it) with
    zeros, the causal convolution's own padding, so every row's window has one width."""
    for layer in _linear_layers(cache).values():
        for s in range(layer.number_of_states):
            conv = layer.conv_states[s]
            if layer.is_conv_states_initialized[s] and conv.shape[-1] < layer.conv_kernel_size[s]:
                extra = layer.conv_kernel_size[s] - conv.shape[-1]
                layer.conv_states[s] = torch.nn.functional.pad(conv, (extra, 0))


def row_states(cache):
    """(dict, index) of every initialized per-row state tensor of `cache`'s stateful layers:
    what rows leaving and entering a batch move (`dict[index]` is [R, ...])."""
    for layer in _linear_layers(cache).values():
        for s in range(layer.number_of_states):
            if layer.is_conv_states_initialized[s]:
                yield layer.conv_states, s
            if layer.is_recurrent_states_initialized[s]:
                yield layer.recurrent_states, s


class RecurrentState(RecordedInputs):
    """Snapshot, record and replay of a hybrid target's stateful layers (module docstring).

    Built once per decoder; `None` from `for_target` when the target has no such layer."""

    def __init__(self, target, mixers: dict[int, torch.nn.Module]):
        self.target = target
        self.mixers = mixers
        self._snapshot: _Snapshot | None = None
        super().__init__(mixers)

    @classmethod
    def for_target(cls, target) -> RecurrentState | None:
        check_recurrent_target(target.config)
        family = _family(target.config)
        if family not in STATEFUL_MIXERS:
            return None
        attr = STATEFUL_MIXERS[family]
        mixers = {}
        for name, module in target.named_modules():
            if name.rsplit(".", 1)[-1] == attr and isinstance(
                getattr(module, "layer_idx", None), int
            ):
                mixers[int(module.layer_idx)] = module
        if not mixers:
            raise ConfigError(f"{family}: found no `{attr}` mixer in the target's decoder layers")
        # NOTE: one RecurrentState per target module: its hooks stay registered, so a second
        # decoder on the same target reuses them.
        existing = getattr(target, "_dspark_ds_recurrent_state", None)
        if existing is not None:
            return existing
        state = cls(target, mixers)
        target._dspark_ds_recurrent_state = state
        return state

    # -- around a forward ------------------------------------------------------------------------
    def _note(self, cache) -> None:
        """Snapshot the states of `cache`'s stateful layers (the mixers' inputs are recorded
        next)."""
        conv, recurrent = {}, {}
        for i, layer in _linear_layers(cache).items():
            conv[i] = {
                s: layer.conv_states[s].clone()
                for s in range(layer.number_of_states)
                if layer.has_previous_state[s] and layer.is_conv_states_initialized[s]
            }
            recurrent[i] = {
                s: layer.recurrent_states[s].clone()
                for s in range(layer.number_of_states)
                if layer.has_previous_state[s] and layer.is_recurrent_states_initialized[s]
            }
        self._snapshot = _Snapshot(conv, recurrent, {})

    def _record(self, layer_idx: int, hidden: torch.Tensor, kwargs: dict) -> None:
        self._snapshot.inputs[layer_idx] = hidden

    def discard(self) -> None:
        self._snapshot = None

    # -- after the verdict -----------------------------------------------------------------------
    def rollback(self, cache, keep_R: list[int], appended: int) -> None:
        """Rows with keep_R[r] < `appended` get the state after their first keep_R[r] tokens of
        the last recorded forward (snapshot, then replay); the others keep theirs. Call after
        the KV layers were cut back."""
        snap, self._snapshot = self._snapshot, None
        if all(k == appended for k in keep_R):
            _pad_conv_windows(cache)
            return
        if snap is None:
            raise RuntimeError("rollback of a recurrent state without a recorded forward")
        layers = _linear_layers(cache)
        missing = [i for i in layers if i not in snap.inputs]
        if missing:
            raise RuntimeError(f"stateful layers {missing} ran no recorded mixer in the forward")
        device = next(iter(snap.inputs.values())).device
        # the states the forward left (and the KV crop cut), with replayed rows written in
        final_conv = {i: dict(layer.conv_states) for i, layer in layers.items()}
        final_rec = {i: dict(layer.recurrent_states) for i, layer in layers.items()}
        for i, layer in layers.items():
            for s in range(layer.number_of_states):
                if final_conv[i].get(s) is not None:
                    final_conv[i][s] = final_conv[i][s][..., -layer.conv_kernel_size[s] :].clone()
        counts = _counts(cache)  # what the crop left; the replay's mixer calls count again
        lengths = sorted({k for k in keep_R if k < appended})
        for length in lengths:
            rows = torch.tensor(
                [r for r, k in enumerate(keep_R) if k == length], dtype=torch.long, device=device
            )
            for i in sorted(layers):
                layer = layers[i]
                self._restore_rows(layer, snap, i, rows)
                if length > 0:  # (none kept: the snapshot itself)
                    self.mixers[i](
                        hidden_states=snap.inputs[i].index_select(0, rows)[:, :length],
                        cache=cache,
                        attention_mask=None,
                    )
                for s in range(layer.number_of_states):
                    if layer.is_conv_states_initialized[s]:
                        width = layer.conv_kernel_size[s]
                        final_conv[i][s][rows] = layer.conv_states[s][..., -width:]
                    if layer.is_recurrent_states_initialized[s]:
                        final_rec[i][s][rows] = layer.recurrent_states[s]
        for i, layer in layers.items():
            for s in range(layer.number_of_states):
                layer.conv_states[s] = final_conv[i][s]
                layer.recurrent_states[s] = final_rec[i][s]
            if i in counts:
                layer.cumulative_length_linear.fill_(counts[i])
            _drop_history(layer)  # (the replay's)
        _pad_conv_windows(cache)

    @staticmethod
    def _restore_rows(layer, snap: _Snapshot, i: int, rows: torch.Tensor) -> None:
        for s in range(layer.number_of_states):
            for states, saved in (
                (layer.conv_states, snap.conv[i]),
                (layer.recurrent_states, snap.recurrent[i]),
            ):
                initialized = (
                    layer.is_conv_states_initialized[s]
                    if states is layer.conv_states
                    else layer.is_recurrent_states_initialized[s]
                )
                if not initialized:
                    continue
                if s not in saved:
                    raise RuntimeError(
                        f"cannot roll layer {i}'s recurrent state back before its first forward"
                    )
                states[s] = saved[s].index_select(0, rows)
