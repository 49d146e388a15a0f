"""The frozen target: load it, tap hidden states at ``layer_ids``, and build training features.

Feature contract (docs/algorithm.md#target-features), shared by the offline cache, online and hybrid modes:
``target_hidden_states [B, S, n*H]`` = the tapped layers concatenated in id order (``-1`` =
embedding output, ``i`` = output of decoder layer ``i`` = HF ``hidden_states[i + 1]``) and
``target_last_hidden_states [B, S, H]`` = the final *normed* state (what the lm_head consumes).

`target_shared_weights` reads just the embedding and lm_head from a target's files (what the
drafter shares with a target that is not in the job, and what an export writes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark_ds.distributed import local_device
from dspark_ds.drafters.common.target_config import text_config, validate_layer_ids
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_model_path, first_line

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TargetConfig:
    """The frozen target model."""

    path: str = ""
    """Local directory or Hugging Face hub id of the target (Qwen3 / Gemma4 causal LM)."""
    layer_ids: list[int] | None = None
    """Tapped layers, strictly increasing, in {-1} ∪ [0, L-1] (-1 = embeddings); None = 5 evenly
    spaced ids from 1 to L-3 (Qwen3-4B/8B: [1, 9, 17, 25, 33])."""
    dtype: str = "bfloat16"
    """Compute dtype of the target: float32 | bfloat16 | float16."""
    device: str | None = None
    """Device for the target; None = cuda:LOCAL_RANK when CUDA is available, else cpu."""
    attn_implementation: str | None = "sdpa"
    """Attention kernel passed to from_pretrained (sdpa | eager | flash_attention_2 | None)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``path`` is a hub id."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the hub. Off by default: never run untrusted code."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"target.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class TargetPathConfig:
    """The target of a subcommand that only reads it (eval, bench-decode, export, tune)."""

    path: str | None = None
    """Local directory or Hugging Face hub id of the target."""


def default_layer_ids(num_layers: int, num_taps: int = 5) -> list[int]:
    """``num_taps`` ids evenly spaced from 1 to L-3 (the paper's defaults), deduplicated."""
    last = max(num_layers - 3, 1)
    if num_taps == 1:
        return [1]
    return sorted({round(1 + k * (last - 1) / (num_taps - 1)) for k in range(num_taps)})


def config_sha256(config) -> str:
    """A stable hash of a target's architecture/weights-relevant config (for cache manifests)."""
    d = config.to_dict()
    for volatile in (
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "_attn_implementation_autoset",
        "_commit_hash",
    ):
        d.pop(volatile, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


class FrozenTarget(nn.Module):
    """A causal LM in eval mode with no gradients that returns the tapped features.

    Taps are forward hooks on the embedding and the chosen decoder layers, so only the ``n``
    tapped states are kept (``output_hidden_states=True`` would hold all ``L + 1``), and the
    lm_head never runs over the whole sequence. The wrapped model is a plain ``nn.Module``: an
    engine may partition it (DeepSpeed ZeRO-3) before or after wrapping; hooks still fire.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        tcfg = text_config(model.config)
        self.hidden_size = int(tcfg.hidden_size)
        self.num_layers = int(tcfg.num_hidden_layers)
        self.vocab_size = int(tcfg.vocab_size)
        self.layer_ids = (
            list(layer_ids) if layer_ids is not None else default_layer_ids(self.num_layers)
        )
        validate_layer_ids(self.layer_ids, self.num_layers, field="target.layer_ids")
        self.decoder = model.get_decoder()
        self._taps: dict[int, torch.Tensor] = {}
        self.decoder.embed_tokens.register_forward_hook(self._hook(-1))
        for i in self.layer_ids:
            if i >= 0:
                self.decoder.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, layer_id: int):
        def fn(_module, _inputs, output):
            if layer_id in self.layer_ids:
                self._taps[layer_id] = output[0] if isinstance(output, tuple) else output

        return fn

    @classmethod
    def from_config(cls, cfg: TargetConfig, device: torch.device | str | None = None):
        from transformers import AutoModelForCausalLM

        if not cfg.path:
            raise ConfigError("target.path is required (a local directory or a hub id)")
        kwargs = {
            "dtype": cfg.torch_dtype,
            "revision": cfg.revision,
            "trust_remote_code": cfg.trust_remote_code,
        }
        if cfg.attn_implementation:
            kwargs["attn_implementation"] = cfg.attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.path, **kwargs)
        except OSError as err:  # not found, not a model, no connection: one line, exit 2
            raise ConfigError(
                f"target.path: cannot load a model from {cfg.path!r} ({first_line(err)})"
            ) from None
        target = cls(model, cfg.layer_ids)
        target.name_or_path = cfg.path
        return target.to(device or cfg.device or local_device())

    def train(self, mode: bool = True):  # noqa: ARG002 - the target never leaves eval mode
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def embed_weight(self) -> nn.Parameter:
        """The input embedding matrix [V, H] (the drafter shares it in online mode)."""
        return self.decoder.embed_tokens.weight

    @property
    def lm_head_weight(self) -> nn.Parameter:
        """The output projection [V, H] (equal to ``embed_weight`` when tied)."""
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """``input_ids [B, S]`` → (``target_hidden_states [B,S,n*H]``, ``target_last [B,S,H]``)."""
        self._taps.clear()
        try:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            # NOTE: HF's hidden_states[L] (= id L-1) is the *normed* final state, not the raw
            # output of the last layer; follow HF so ids mean the same as in the reference.
            self._taps[self.num_layers - 1] = out.last_hidden_state
            hidden = torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
        finally:
            self._taps.clear()
        return hidden, out.last_hidden_state


class TargetFeatureProvider:
    """Online features: a collated token batch in, the full training batch (contract) out.

    ``batch`` holds ``input_ids [B,S]``, ``loss_mask [B,S]`` and optionally ``attention_mask``
    (1 = real token; right padding). Padding positions get zero features, exactly like batches
    collated from the offline cache, so every mode yields the same tensors.
    """

    def __init__(self, target: FrozenTarget, out_dtype: torch.dtype | None = None):
        self.target = target
        self.out_dtype = out_dtype

    def __call__(self, batch: dict) -> dict:
        device = self.target.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        attn = batch.get("attention_mask")
        attn = (
            input_ids.new_ones(input_ids.shape)
            if attn is None
            else attn.to(device, non_blocking=True)
        )
        hidden, last = self.target(input_ids, attention_mask=attn)
        keep = attn.unsqueeze(-1).to(hidden.dtype)
        out = dict(batch)
        out["input_ids"] = input_ids
        out["attention_mask"] = attn
        out["loss_mask"] = batch["loss_mask"].to(device, non_blocking=True)
        dtype = self.out_dtype or hidden.dtype
        out["target_hidden_states"] = (hidden * keep).to(dtype)
        out["target_last_hidden_states"] = (last * keep).to(dtype)
        return out


def load_target(cfg: TargetConfig, device: torch.device | str | None = None) -> FrozenTarget:
    """Load the frozen target described by ``cfg`` (eval mode, no gradients)."""
    check_model_path(cfg.path, "target.path")
    return FrozenTarget.from_config(cfg, device)


def share_embeddings_and_head(drafter: nn.Module, target: FrozenTarget) -> None:
    """Online mode: make the drafter use the target's very embedding and lm_head tensors.

    Instead of copies (``initialize_embeddings_and_head``), the drafter's ``embed_tokens.weight``
    and ``lm_head.weight`` become the target's frozen Parameters: one copy in memory, and the
    drafter can never drift from the target. NOTE: call it before an engine casts or partitions
    the drafter, and keep the target in the same dtype (a cast of the drafter casts the shared
    tensors too).
    """

    def shape(p: torch.Tensor) -> tuple[int, ...]:  # a ZeRO-3 partitioned Parameter: ds_shape
        return tuple(getattr(p, "ds_shape", p.shape))

    for name, module, weight in (
        ("embed_tokens", drafter.embed_tokens, target.embed_weight),
        ("lm_head", drafter.lm_head, target.lm_head_weight),
    ):
        if shape(module.weight) != shape(weight):
            raise ConfigError(
                f"{name}: target weight {shape(weight)} != drafter {shape(module.weight)}"
            )
        weight.requires_grad_(False)
        module.weight = weight


def target_shared_weights(target_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V,H], lm_head [V,H]) read straight from the target's safetensors, without
    loading the whole target. Tied targets return the embedding twice."""
    from safetensors import safe_open

    root = Path(target_path)
    files: dict[str, Path] = {}
    index = root / "model.safetensors.index.json"
    if index.exists():
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            files[name] = root / shard
    elif (root / "model.safetensors").exists():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            files = {name: root / "model.safetensors" for name in f.keys()}
    else:
        raise ConfigError(f"target.path: {root} has no model.safetensors(.index.json)")

    def find(suffixes: tuple[str, ...]) -> torch.Tensor | None:
        for name, file in files.items():
            if name.endswith(suffixes):
                with safe_open(str(file), framework="pt") as f:
                    return f.get_tensor(name)
        return None

    embed = find(("embed_tokens.weight",))
    if embed is None:
        raise ConfigError(f"target.path: {root} has no *embed_tokens.weight tensor")
    head = find(("lm_head.weight",))
    return embed, (embed if head is None else head)
