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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from dspark_ds.distributed import local_device
from dspark_ds.drafters.common import families
from dspark_ds.drafters.common.target_config import text_config, validate_layer_ids
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_model_path, first_line
from dspark_ds.target_checkpoint import causal_lm_config, read_target_config
from dspark_ds.target_weights import TargetWeights, local_target_dir

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TargetConfig:
    """The frozen target model."""

    path: str = ""
    """Local directory or Hugging Face hub id of the target: a causal LM of any family
    transformers loads (docs/drafters.md#target-families)."""
    layer_ids: list[int] | None = None
    """Tapped layers, strictly increasing, in {-1} ∪ [0, L-1] (-1 = embeddings); None = 5 evenly
    spaced ids from 1 to L-3 (Qwen3-4B/8B: [1, 9, 17, 25, 33])."""
    dtype: str = "bfloat16"
    """Compute dtype of the target: float32 | bfloat16 | float16."""
    device: str | None = None
    """Device for the target; None = cuda:LOCAL_RANK when CUDA is available, else cpu."""
    attn_implementation: str | None = None
    """Attention kernel passed to from_pretrained (sdpa | eager | flash_attention_2); None =
    transformers' choice for the family (sdpa where the family has it, else eager: gpt-oss)."""
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


def _model_kwargs(cfg: TargetConfig) -> dict:
    kwargs = {"dtype": cfg.torch_dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    return kwargs


@contextmanager
def _attention_kernel(cfg: TargetConfig, config) -> Iterator[None]:
    """Turns transformers' refusal of an attention kernel the family lacks (DeepSeek-V4 has no
    sdpa) into one line naming the option."""
    try:
        yield
    except ValueError as err:
        if "attention implementation" not in str(err):
            raise
        raise ConfigError(
            f"attn_implementation: the {causal_lm_config(config).model_type} target at "
            f"{cfg.path} has no {cfg.attn_implementation!r} kernel in transformers; choose "
            "eager, or leave it unset for the family's default"
        ) from None


def target_model_config(cfg: TargetConfig, partitioned: bool = False):
    """The target's transformers config (ConfigError when it cannot be read). `partitioned`:
    for a target loaded partition by partition (ZeRO-3), which reads plain weights only."""
    config = read_target_config(
        cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
    )
    quant = getattr(config, "quantization_config", None)
    if partitioned and quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"target.path: {cfg.path} is a quantized checkpoint (quantization_config: {method}); "
            "under ZeRO-3 the target is read partition by partition from plain (bf16 / fp32) "
            "weights: use a dequantized copy, or ZeRO 0-2"
        )
    return config


def import_target_class(config) -> None:
    """Imports the modelling module of `config`'s causal LM class.

    NOTE: call it before `deepspeed.zero.Init`: a class first defined inside that context gets
    its `__init__` reset to the undecorated function when the context exits, which drops what
    a decorator added (transformers' MoE experts then lack `self.config`)."""
    # lazy: transformers, 0.9 s of import
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(causal_lm_config(config))]
    except (KeyError, ValueError):  # remote code: imported by from_config itself
        pass


def build_target_model(cfg: TargetConfig, config) -> nn.Module:
    """The target's model class built from `config`, its weights left uninitialised (they are
    read from the checkpoint next; under `zero.Init` each parameter is partitioned as its module
    is built, and transformers' init would index into the empty partitions). A vision-language
    checkpoint's target is its text model (`target_checkpoint.causal_lm_config`)."""
    # lazy: transformers, 0.9 s of import
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), _attention_kernel(cfg, config):  # NOTE: no tying of embeddings
        model = AutoModelForCausalLM.from_config(causal_lm_config(config), **_model_kwargs(cfg))
    model.tie_weights()
    return model


def load_causal_lm(cfg: TargetConfig) -> nn.Module:
    """The target's causal LM on the CPU: `AutoModelForCausalLM.from_pretrained`, or, for a
    vision-language checkpoint whose family has none (Kimi-K2.5), its text model built from the
    text config and filled with the text model's weights alone (the vision tower is not read)."""
    # lazy: transformers, 0.9 s of import
    from transformers import AutoModelForCausalLM

    config = target_model_config(cfg)
    if causal_lm_config(config) is config:
        with _attention_kernel(cfg, config):
            return AutoModelForCausalLM.from_pretrained(
                cfg.path, config=config, revision=cfg.revision, **_model_kwargs(cfg)
            )
    model = build_target_model(cfg, config)
    weights = TargetWeights(local_target_dir(cfg.path, cfg.revision))
    state = {name: source.read().view(source.shape) for name, source in weights.sources(model)}
    missing, _ = model.load_state_dict(state, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=True)}
    missing = [name for name in missing if name in tied]
    if missing:
        raise ConfigError(
            f"target.path: {cfg.path} holds no value for {missing[0]} of its "
            f"{config.model_type} checkpoint's text model ({len(missing)} missing)"
        )
    return model.eval()


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


def decoder_layers(decoder: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder's `num_layers` layers (`.layers` in most families, `.h` in GPT-2-like ones)."""
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for child in decoder.children():
        if isinstance(child, nn.ModuleList) and len(child) == num_layers:
            return child
    raise ConfigError(
        f"target.path: {type(decoder).__name__} has no list of its {num_layers} decoder layers "
        "(num_hidden_layers) to tap"
    )


def _first_tensor(value) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def residual_state(hidden: torch.Tensor) -> torch.Tensor:
    """A decoder layer's hidden state as the features take it, [B, S, H]. DeepSeek-V4's
    hyper-connections keep `hc_mult` residual streams, [B, S, hc_mult, H], which its own
    layers mix with weights computed per token and its head collapses only after the last
    layer: a tapped layer is the mean of its streams (they all start as the embedding, so id
    -1 is the embedding itself; the last id is the final normed state, as for every family)."""
    return hidden.mean(dim=-2) if hidden.dim() == 4 else hidden


class FrozenTarget(nn.Module):
    """A causal LM of any family in eval mode with no gradients that returns the tapped features.

    Taps are forward hooks: a pre-hook on decoder layer 0 takes its input (id -1, the embedding
    output as the layers see it, scaled where the family scales it) and a hook on layer i its
    output, so only the ``n`` tapped states are kept (``output_hidden_states=True`` would hold
    all ``L + 1``; `tests/unit/test_target_families.py` checks the taps equal them in every tested
    family), and the lm_head never runs over the whole sequence. The wrapped model is a plain
    ``nn.Module``: an engine may partition it (DeepSpeed ZeRO-3) before or after wrapping;
    hooks still fire.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        tcfg = text_config(model.config)
        self.family = families.family(tcfg)
        self.hidden_size = int(tcfg.hidden_size)
        self.num_layers = int(tcfg.num_hidden_layers)
        self.vocab_size = int(tcfg.vocab_size)
        self.layer_ids = (
            list(layer_ids) if layer_ids is not None else default_layer_ids(self.num_layers)
        )
        validate_layer_ids(self.layer_ids, self.num_layers, field="target.layer_ids")
        self.decoder = model.get_decoder()
        layers = decoder_layers(self.decoder, self.num_layers)
        self._taps: dict[int, torch.Tensor] = {}
        layers[0].register_forward_pre_hook(self._embedding_hook, with_kwargs=True)
        for i in self.layer_ids:
            if i >= 0:
                layers[i].register_forward_hook(self._hook(i))

    def _embedding_hook(self, _module, args, kwargs):
        if -1 in self.layer_ids:
            self._taps[-1] = residual_state(args[0] if args else kwargs["hidden_states"])

    def _hook(self, layer_id: int):
        def fn(_module, _inputs, output):
            if layer_id in self.layer_ids:
                self._taps[layer_id] = residual_state(_first_tensor(output))

        return fn

    @torch.no_grad()
    def check_head(self, num_tokens: int = 8) -> None:
        """Refuses a target whose logits are not lm_head(final normed state), what a
        Qwen3-style drafter computes with the shared lm_head (families with their own drafter
        backbone are left alone), from one forward on a few tokens. Every rank calls it (under
        ZeRO-3 the forward is collective)."""
        if families.is_native(self.family):
            return
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ConfigError(
                f"target.path: the {self.family} target's lm_head has a bias, which the "
                "Qwen3-style drafter's shared lm_head does not; not supported"
            )
        seen: dict[str, torch.Tensor] = {}
        hook = self.decoder.register_forward_hook(
            lambda _m, _i, out: seen.__setitem__("last", out.last_hidden_state)
        )
        ids = torch.arange(num_tokens, device=self.device).remainder(self.vocab_size)
        try:
            logits = self.model(input_ids=ids.unsqueeze(0), use_cache=False).logits.float()
        finally:
            hook.remove()
        plain = head(seen["last"]).float()
        scale = float(plain.abs().max()) + 1e-6
        if not torch.allclose(logits, plain, rtol=1e-3, atol=1e-3 * scale):
            diff = float((logits - plain).abs().max())
            raise ConfigError(
                f"target.path: the {self.family} target's logits differ from lm_head(final "
                f"hidden state) by up to {diff:.3g} (soft-capped or scaled logits); the "
                "Qwen3-style drafter cannot share such a head"
            )

    @classmethod
    def from_config(cls, cfg: TargetConfig, device: torch.device | str | None = None):
        try:
            model = load_causal_lm(cfg)
        except OSError as err:  # not found, not a model, no connection: one line, exit 2
            raise ConfigError(
                f"target.path: cannot load a model from {cfg.path!r} ({first_line(err)})"
            ) from None
        target = cls(model, cfg.layer_ids)
        target.name_or_path = cfg.path
        target = target.to(device or cfg.device or local_device())
        target.check_head()
        return target

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
        return self.model.get_input_embeddings().weight

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

    pairs = [("embed_tokens", drafter.embed_tokens, target.embed_weight)]
    if getattr(drafter, "draft_vocab", 0):  # its own head: the target's rows of its tokens
        head, own = target.lm_head_weight, drafter.lm_head.weight
        # NOTE: ZeRO-3-partitioned, the engine copies them gathered (engine/drafter.py)
        if not (hasattr(head, "ds_shape") or hasattr(own, "ds_shape")):
            with torch.no_grad():
                own.copy_(drafter.head_weight_rows(head.detach()))
        own.requires_grad_(False)
    else:
        pairs.append(("lm_head", drafter.lm_head, target.lm_head_weight))
    for name, module, weight in pairs:
        if shape(module.weight) != shape(weight):
            raise ConfigError(
                f"{name}: target weight {shape(weight)} != drafter {shape(module.weight)}"
            )
        weight.requires_grad_(False)
        module.weight = weight


def _meta_target(target_path: str):
    """(the target's local directory, its model built on the meta device, {id(parameter): its
    names}): what the readers below use to learn a parameter's name in any family."""
    # lazy: transformers, 0.9 s of import
    from transformers import AutoModelForCausalLM

    root = local_target_dir(target_path)
    config = read_target_config(str(root))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(causal_lm_config(config))
    names: dict[int, list[str]] = {}  # a tied weight has both names; the checkpoint one
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return root, model, names


def target_shared_weights(target_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V,H], lm_head [V,H]) read straight from the target's safetensors, without
    loading the whole target: the model is built on the meta device to learn the two
    parameters' names (any family), then only those tensors are read. Tied targets return the
    embedding twice."""
    root, model, names = _meta_target(target_path)
    embed_names = names[id(model.get_input_embeddings().weight)]
    head = model.get_output_embeddings()
    head_names = names[id(head.weight)] if head is not None else embed_names
    found = {
        name: source.read().view(source.shape)
        for name, source in TargetWeights(root).sources(model, only={*embed_names, *head_names})
    }
    embed = next((found[n] for n in embed_names if n in found), None)
    if embed is None:
        raise ConfigError(f"target.path: {root} holds no {embed_names[0]} tensor (the embedding)")
    return embed, next((found[n] for n in head_names if n in found), embed)


def target_final_norm(target_path: str) -> nn.Module:
    """The target's final norm (the decoder's ``norm``, on the CPU in float32, frozen) read from
    its safetensors: what turns the last layer's raw output into the state the lm_head consumes,
    for a served target whose files hold the raw one (`dspark_ds.serve.hidden_states`)."""
    root, model, _ = _meta_target(target_path)
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ConfigError(
            f"target.path: the {model.config.model_type} target's decoder has no final `norm` "
            "module; a served target's last hidden state cannot be normed here"
        )
    prefix = next(n for n, m in model.named_modules() if m is norm) + "."
    wanted = {prefix + n for n, _ in norm.named_parameters()}
    wanted |= {prefix + n for n, _ in norm.named_buffers()}
    found = {
        name.removeprefix(prefix): source.read().view(source.shape)
        for name, source in TargetWeights(root).sources(model, only=wanted)
    }
    missing = sorted(n for n in wanted if n.removeprefix(prefix) not in found)
    if any(n.removeprefix(prefix) in dict(norm.named_parameters()) for n in missing):
        raise ConfigError(f"target.path: {root} holds no {missing[0]} tensor (the final norm)")
    norm = norm.to_empty(device="cpu").float()
    norm.load_state_dict({k: v.float() for k, v in found.items()}, strict=False)
    return norm.eval().requires_grad_(False)
