"""What every kind's drafter config starts from, the backends by architecture, and the
interchange directory (docs/checkpoint-format.md).

A kind builds its drafter config in its own folder (drafters/<kind>/build.py, called by its
`DrafterKind.build_config`) from `draft_config_from_target` and `finalize_draft_config` here.
A drafter directory is `config.json` (the draft text config plus the kind's fields) and
`model.safetensors` (or shards with `model.safetensors.index.json`), in the format the engines
load as it is (drafters/serving.py: chosen by the kind and layout; DeepSpec's for DSpark, the
DFlash and vLLM Eagle3 formats for the others). `architectures` selects the backend.
`save_speculators_model` writes speculators 0.9's directory instead
(drafters/speculators_format.py), which every reader here reads too.

`config.json` keeps the `model_type` of the drafter's backbone: the target's own for Qwen3 and
Gemma4 targets (qwen3, gemma4_text), "qwen3" for every other family, whose drafter is the
Qwen3 backbone sized from the target (drafters/common/families.py); `target_model_type` and
`target_text_model_type` name the target's family. The reference implementation, SGLang and
vLLM read `model_type` as the drafter's config class. transformers' Auto classes
map that config class to the plain causal LM, and use `architectures` only to choose among the
classes registered for it; `register_auto_classes()` (an explicit call: importing the package
leaves transformers' tables alone) adds the drafter architectures there, so
`AutoModelForCausalLM.from_pretrained(drafter_dir)` returns the drafter instead of a
Qwen3ForCausalLM that silently drops its heads. The package loads drafters with
`load_draft_model` and needs no registration.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dspark_ds.drafters import serving, speculators_format
from dspark_ds.drafters.common import families
from dspark_ds.drafters.common.target_config import text_config, validate_layer_ids
from dspark_ds.drafters.registry import REGISTERED
from dspark_ds.errors import ConfigError
from dspark_ds.files import save_safetensors

# architecture -> (module, class, transformers config class path), every registered kind's
BACKENDS: dict[str, tuple[str, str, str]] = {
    a: backend for r in REGISTERED.values() for a, backend in r.backends.items()
}
# drafter kind -> target text model_type -> architecture, for the families with a backbone of
# their own; every other family gets GENERIC_ARCHITECTURES (drafters/common/families.py)
ARCHITECTURES: dict[str, dict[str, str]] = {
    r.name: dict(r.architectures) for r in REGISTERED.values()
}
# drafter kind -> the Qwen3-style architecture built for a target of any other family
GENERIC_ARCHITECTURES: dict[str, str] = {
    r.name: r.generic_architecture for r in REGISTERED.values()
}
# drafter kind -> target text model_type -> architecture of `model.backbone: target` beyond those
TARGET_ARCHITECTURES: dict[str, dict[str, str]] = {
    r.name: dict(r.target_backbones) for r in REGISTERED.values()
}


def architecture_for(kind: str, model_type: str, backbone: str = "auto") -> str:
    """The drafter architecture `kind` builds for a target whose text model_type is this;
    `backbone` "target": the target family's own layers, ConfigError where `kind` has none."""
    if backbone == "target":
        own = {**ARCHITECTURES[kind], **TARGET_ARCHITECTURES[kind]}
        if model_type not in own:
            raise ConfigError(
                f"backbone: target: the {kind} drafter has no {model_type} decoder layers (it has "
                f"them for {', '.join(sorted(own))}); use backbone: auto"
            )
        return own[model_type]
    return ARCHITECTURES[kind].get(model_type, GENERIC_ARCHITECTURES[kind])


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _backend(architecture: str):
    if architecture not in BACKENDS:
        raise ConfigError(
            f"architectures: unknown drafter architecture {architecture!r}; known: {sorted(BACKENDS)}"
        )
    module, cls, config_cls = BACKENDS[architecture]
    return getattr(importlib.import_module(module), cls), _import(config_cls)


def draft_config_from_target(
    target_config,
    kind: str,
    target_layer_ids: list[int],
    num_draft_layers: int,
    backbone: str = "auto",
):
    """What every drafter config starts as: the target's text config (a deep copy for the
    families with their own backbone, the Qwen3-style translation for the others) with the
    drafter's layers, the tapped ids, the backend's architecture and the target's family
    (`target_model_type`, `target_text_model_type`). Returns (config, text)."""
    text = text_config(target_config)
    model_type = families.family(text)
    num_target_layers = int(text.num_hidden_layers)
    ids = validate_layer_ids(target_layer_ids, num_target_layers)
    architecture = architecture_for(kind, model_type, backbone)
    if architecture != GENERIC_ARCHITECTURES[kind]:
        cfg = copy.deepcopy(text)
    else:
        cfg = families.qwen3_style_config(text)
    cfg.architectures = [architecture]
    cfg.num_target_layers = num_target_layers
    cfg.num_hidden_layers = int(num_draft_layers)
    cfg.layer_types = ["full_attention"] * int(num_draft_layers)
    cfg.tie_word_embeddings = False
    if hasattr(cfg, "use_sliding_window"):
        cfg.use_sliding_window = False
    cfg.target_layer_ids = ids
    cfg.target_model_type = str(getattr(target_config, "model_type", None) or model_type)
    cfg.target_text_model_type = model_type
    return cfg, text


def finalize_draft_config(cfg, text):
    """The backend's own fix-ups (Gemma4 rebuilds its per-layer attributes)."""
    cls, _ = _backend(cfg.architectures[0])
    return cls.finalize_draft_config(cfg, text)


def build_draft_model(config):
    """Instantiates the backend named by `config.architectures[0]` (random init)."""
    cls, _ = _backend(config.architectures[0])
    return cls(config)


def config_from_dict(data: dict, target_config=None):
    """A drafter config from its config.json (ours, DeepSpec's or an engine format's,
    `serving.native_dict`); names the first missing field the architecture needs.
    `target_config` fills what a published checkpoint leaves to the target."""
    data = serving.native_dict(data, target_config)
    archs = data.get("architectures") or []
    if not archs:
        raise ConfigError("architectures: missing from the drafter config.json")
    cls, config_cls = _backend(archs[0])
    missing = [f for f in cls.REQUIRED_CONFIG_FIELDS if f not in data]
    if missing:
        raise ConfigError(
            f"{missing[0]}: missing from the drafter config.json ({archs[0]} needs {missing})"
        )
    return config_cls.from_dict({**cls.OPTIONAL_CONFIG_FIELDS, **data})


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """One weights file; a damaged one (truncated, not safetensors) is a ConfigError naming it."""
    try:
        return load_file(file)
    except (SafetensorError, OSError) as err:
        raise ConfigError(
            f"{file}: not a readable safetensors file ({err}); export the drafter again"
        ) from None


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter directory (one file, or the shards of its index)."""
    single = path / "model.safetensors"
    if single.exists():
        return _load_safetensors(single)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{index}: not a safetensors index ({err!r})") from None
        state = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).exists():
                raise ConfigError(f"{path / shard}: listed in {index.name} but missing")
            state.update(_load_safetensors(path / shard))
        return state
    raise ConfigError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_config_dict(path: Path) -> dict:
    """A drafter directory's config.json as written (ConfigError naming the file)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"{cfg_file}: not found (is {path} a drafter directory?)")
    try:
        data = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{cfg_file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg_file}: not a JSON object")
    return data


def load_draft_model(
    path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    target_config=None,
    shared_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Reads a drafter directory (ours, the reference's, or an engine format's: a published
    DFlash or vLLM Eagle3 checkpoint) into a drafter, in eval mode. A published checkpoint that
    leaves the embedding and lm_head to the target gets `shared_weights` (the target's
    (embedding, lm_head)); `target_config` fills the config fields it leaves to the target."""
    model, state = _read_drafter(path, target_config, shared_ok=False, shared=shared_weights)
    model.load_state_dict(state, strict=True)
    model.freeze_shared()
    return model.to(device=device, dtype=dtype).eval()


def read_init_state(path, target_config=None) -> dict[str, torch.Tensor]:
    """The weights of a drafter directory (any format `load_draft_model` reads) under our
    parameter names, checked against its config; the embedding and lm_head may be absent (a
    run takes them from its target). What `model.init_from` starts a run from."""
    return _read_drafter(path, target_config, shared_ok=True)[1]


def check_init_state(state: dict[str, torch.Tensor], config, source) -> None:
    """`model.init_from`'s weights (`read_init_state` of `source`) against the run's drafter,
    built from `config` on the meta device: ConfigError naming the first tensor the drafter has
    no place for, has in another shape, or trains and the checkpoint lacks (the embedding and
    lm_head are the target's). Nothing of the checkpoint is dropped, nothing left random."""
    with torch.device("meta"):
        model = build_draft_model(config)
    own = model.state_dict()
    shared = set(model.shared_parameter_names())
    problems = [f"{n} (no such weight in the run's drafter)" for n in sorted(set(state) - set(own))]
    problems += [
        f"{n} (shape {tuple(state[n].shape)}, the run's drafter {tuple(own[n].shape)})"
        for n in sorted(set(state) & set(own))
        if tuple(state[n].shape) != tuple(own[n].shape)
    ]
    problems += [f"{n} (missing)" for n in sorted(set(own) - set(state) - shared)]
    if problems:
        more = f", +{len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConfigError(
            f"model.init_from: {source} does not fit the run's drafter: "
            f"{'; '.join(problems[:3])}{more}; set the model section to the checkpoint's"
        )


def _read_drafter(path, target_config, *, shared_ok: bool, shared=None):
    """(the drafter built from the directory's config, its checked tensors)."""
    path = Path(path)
    cfg_file = path / "config.json"
    data = read_config_dict(path)
    try:
        model = build_draft_model(config_from_dict(data, target_config))
    except ConfigError as err:
        raise ConfigError(f"{cfg_file}: {err}") from None
    state = type(model).native_state_dict(read_state_dict(path), model.config)
    own = model.state_dict()
    names = model.shared_parameter_names()
    if shared is not None:
        for name, tensor in zip(names, shared):
            state.setdefault(name, tensor)
    missing = sorted(set(own) - set(state))
    if missing and set(missing) <= set(names):
        if shared_ok:
            missing = []
        else:
            raise ConfigError(
                f"{path}: has no {' / '.join(missing)} (a checkpoint that shares them with its "
                "target); load it with the target's (shared_weights, or target.path)"
            )
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ConfigError(
            f"{path}: weights do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ConfigError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, config expects {tuple(own[name].shape)}"
            )
    return model, state


def draft_config_dict(config) -> dict:
    data = config.to_dict()
    for key in [k for k in data if k.startswith("_")]:
        data.pop(key)
    return data


def _write_weights(out: Path, state: dict[str, torch.Tensor]) -> None:
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    # NOTE: tied targets (Gemma4, small Qwen3) can hand one tensor as both embed_tokens and
    # lm_head; safetensors refuses shared storage, so each name gets its own copy.
    seen: set[int] = set()
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            state[name] = tensor.clone()
        seen.add(ptr)
    save_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})


def _write_config(out: Path, data: dict) -> None:
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(out / "config.json")


def _native_config(model) -> dict:
    """The drafter's config.json dict as our backends read it, with its `architectures`."""
    data = draft_config_dict(model.config)
    family_hook = getattr(type(model), "interchange_config_dict", None)  # Gemma4 layout
    if family_hook is not None:
        data = family_hook(data, model.config)
    data["architectures"] = [type(model).architecture]
    return data


def save_draft_model(model, out_dir, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Writes `config.json` + `model.safetensors`. `state_dict` overrides the module's own
    (the engine passes gathered ZeRO-3 weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = state_dict if state_dict is not None else model.state_dict()
    _write_weights(out, type(model).interchange_state_dict(state, model.config))
    _write_config(out, serving.engine_dict(_native_config(model)))
    return out


def save_speculators_model(
    model, out_dir, state_dict: dict[str, torch.Tensor] | None = None, *, target_path: str
) -> Path:
    """Writes the drafter in the speculators format (drafters/speculators_format.py) for the
    target at `target_path` (its verifier): `config.json` + `model.safetensors`, without the
    embedding and lm_head for a kind whose speculators checkpoints leave them to the target.
    ConfigError (before anything is written) names what the format cannot hold."""
    state = state_dict if state_dict is not None else model.state_dict()
    native = _native_config(model)
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    data = speculators_format.speculators_dict(
        native, speculators_format.verifier_of(target_path), dtype
    )
    shared = tuple(model.shared_parameter_names())
    keep = speculators_format.saved_names(native, list(state), shared)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out, {name: state[name] for name in keep})
    _write_config(out, data)
    return out


# ---- transformers' Auto classes ---------------------------------------------------------------
# Arguments transformers' Auto classes pass along that mean nothing for a local drafter.
_AUTO_INTERNAL_KWARGS = (
    "_from_auto",
    "trust_remote_code",
    "adapter_kwargs",
    "cache_dir",
    "local_files_only",
    "token",
    "subfolder",
    "force_download",
    "proxies",
    "code_revision",
    "config",
)


def _auto_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    """What `AutoModel*.from_pretrained` calls on a drafter directory: `load_draft_model`,
    with transformers' `dtype` (default: the config's) and `device_map` (one device)."""
    config = kwargs.get("config")
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    device = kwargs.pop("device_map", None) or "cpu"
    revision = kwargs.pop("revision", None)
    for name in _AUTO_INTERNAL_KWARGS:
        kwargs.pop(name, None)
    if model_args or kwargs or isinstance(device, dict):
        unsupported = sorted(kwargs) + (["device_map (a dict)"] if isinstance(device, dict) else [])
        raise TypeError(
            f"{cls.__name__}.from_pretrained: {unsupported or list(model_args)} not supported "
            "for a dspark-ds drafter (dtype and a single-device device_map are)"
        )
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path = Path(pretrained_model_name_or_path)
    if not path.is_dir():  # a hub id: the config came from there too
        # lazy: huggingface_hub's downloads, 0.3 s of import
        from huggingface_hub import snapshot_download

        path = Path(
            snapshot_download(
                str(pretrained_model_name_or_path),
                revision=revision,
                allow_patterns=["*.json", "*.safetensors"],
            )
        )
    return load_draft_model(path, dtype=dtype, device=device)


class _AutoEntry(type):
    """Metaclass of what `register_auto_classes` puts in transformers' Auto mappings: every
    attribute is the class transformers had (`_from_config`, `config_class`, ...), so building
    or loading a plain model behaves exactly as before; only `from_pretrained` first checks
    whether `config.architectures` names a drafter."""

    def __getattr__(cls, name):
        return getattr(cls.__dict__["_dspark_original"], name)


def _auto_entry(original: type, architectures: tuple[str, ...]) -> type:
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        named = getattr(kwargs.get("config"), "architectures", None) or ()
        if any(a in architectures for a in named):
            return _auto_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return original.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    return _AutoEntry(
        original.__name__,
        (),
        {
            "_dspark_original": original,
            "__module__": original.__module__,
            "__doc__": original.__doc__,
            "from_pretrained": classmethod(from_pretrained),
        },
    )


def register_auto_classes() -> None:
    """Make transformers' `AutoModel` / `AutoModelForCausalLM.from_pretrained(drafter_dir)`
    return the drafter (what `load_draft_model` returns).

    NOTE: transformers picks the model class from `model_type` alone (the drafter keeps its
    family's, for the interchange format). Each family's entry is replaced by a stand-in that
    forwards everything to the class transformers had, except that `from_pretrained` of a
    config whose `architectures` names a drafter loads the drafter. A list of classes instead
    would break transformers' own `from_config` of configs without `architectures` (e.g. a
    Gemma4 text config built in code). Idempotent."""
    # lazy: transformers, 0.9 s of import
    from transformers import AutoModel, AutoModelForCausalLM

    by_config: dict[type, list[str]] = {}
    for architecture, (_, _, config_path) in BACKENDS.items():
        by_config.setdefault(_import(config_path), []).append(architecture)
    for auto in (AutoModel, AutoModelForCausalLM):
        mapping = auto._model_mapping
        for config_cls, architectures in by_config.items():
            if config_cls not in mapping:
                continue
            current = mapping[config_cls]
            current = getattr(current, "__dict__", {}).get("_dspark_original", current)
            if not isinstance(current, type):  # several classes already: leave them alone
                continue
            auto.register(config_cls, _auto_entry(current, tuple(architectures)), exist_ok=True)
