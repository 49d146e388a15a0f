"""A target's checkpoint read tensor by tensor, under the names of the model transformers builds.

What ZeRO-3 uses to load a target without any rank holding all of it (engine/target.py,
`load_partitioned_target`): the model is built from its config inside `deepspeed.zero.Init`
(each parameter partitioned as soon as its module exists) and each rank then reads, for every
parameter, only the flat range of elements its partition holds.

- `StoredTensor.read(start, end)`: elements [start, end) of a tensor in a safetensors file, by
  one positioned read of exactly those bytes (no memory map: the process holds nothing of the
  file beyond what it asked for).
- `TargetWeights.sources(model)`: every parameter and persistent buffer of `model` with where
  its value comes from, in the order of the files. Most are one stored tensor; some families
  store several tensors that transformers turns into one parameter on load (Qwen3-MoE and
  DeepSeek-V3 checkpoints keep one tensor per expert, the models one fused `experts.gate_up_proj`
  per layer): those are read whole, a group at a time, and converted by transformers' own
  renamings and converters (the ones `from_pretrained` applies, `conversion_mapping.py`), so a
  group is the largest thing a rank holds in full.

safetensors layout: an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the
data, each tensor contiguous and row-major from `8 + N + begin`.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark_ds.errors import ConfigError
from dspark_ds.files import looks_local
from dspark_ds.target_checkpoint import is_text_model_of, text_model_names, whole_model_on_meta

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of its first element in the file."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def read(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Flat elements [start, end) (default: all) as a 1-D tensor in the stored dtype."""
        end = self.numel if end is None else end
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"range [{start}, {end}) outside {self.numel} elements")
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        buf = bytearray((end - start) * itemsize)
        if not buf:
            return torch.empty(0, dtype=self.dtype)
        view = memoryview(buf)
        with open(self.file, "rb", buffering=0) as f:
            pos, done = self.offset + start * itemsize, 0
            while done < len(buf):
                got = os.preadv(f.fileno(), [view[done:]], pos + done)
                if got <= 0:
                    raise ConfigError(f"target.path: {self.file} is truncated")
                done += got
        return torch.frombuffer(buf, dtype=self.dtype)

    def full(self) -> torch.Tensor:
        return self.read().view(self.shape)


class Computed:
    """A parameter's value computed in full (a converted group's output)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def read(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        flat = self.tensor.reshape(-1)
        return flat[start : flat.numel() if end is None else end]


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConfigError(f"target.path: {file} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"target.path: {file} has no valid safetensors header") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ConfigError(f"target.path: {file}: {name} has dtype {entry['dtype']}")
        out[name] = StoredTensor(
            file=file,
            dtype=_DTYPES[entry["dtype"]],
            shape=tuple(int(d) for d in entry["shape"]),
            offset=8 + size + int(entry["data_offsets"][0]),
        )
    return out


def local_target_dir(path: str, revision: str | None = None) -> Path:
    """The directory holding a target's files: `path` itself, or the hub snapshot of its
    config and safetensors files."""
    if Path(path).expanduser().is_dir() or looks_local(path):
        return Path(path).expanduser()
    # lazy: huggingface_hub's downloads, 0.3 s of import
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.safetensors"])
    )


def state_names(model: nn.Module) -> list[str]:
    """The names `model.state_dict()` has (tied parameters under every name, persistent buffers)
    without calling it."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


class TargetWeights:
    """The tensors of a target directory's safetensors files (`model.safetensors` or the shards
    of `model.safetensors.index.json`), by name."""

    def __init__(self, root: Path):
        self.root = Path(root)
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.root / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise ConfigError(
                f"target.path: {self.root} has no model.safetensors(.index.json); ZeRO-3 reads a "
                "target's safetensors files partition by partition"
            )
        self.tensors: dict[str, StoredTensor] = {}
        for name in files:
            self.tensors.update(read_header(self.root / name))

    def sources(
        self, model: nn.Module, only: set[str] | None = None
    ) -> Iterator[tuple[str, StoredTensor | Computed]]:
        """(name in `model`'s state dict, where its value is) for every stored tensor the model
        uses (or only those named in `only`), one stored tensor or one converted group at a
        time, with the key renamings and converters transformers' `from_pretrained` applies to
        this model. `model` may be on the meta device. The text model of a vision-language
        checkpoint (`target_checkpoint.causal_lm_config`) is read under the whole model's
        names and conversions, renamed to its own; nothing else of the checkpoint is read."""
        whole_config = self._whole_config(model)
        if whole_config is None:
            yield from self._sources(model, only)
            return
        whole = whole_model_on_meta(whole_config)
        renames = text_model_names(whole, model)

        def rename(name: str) -> str | None:
            for theirs, ours in renames.items():
                if name.startswith(theirs):
                    return ours + name.removeprefix(theirs)
            return None

        wanted = {n for n in state_names(whole) if rename(n) is not None}
        if only is not None:
            wanted = {n for n in wanted if rename(n) in only}
        for name, source in self._sources(whole, wanted):
            yield rename(name), source

    def _whole_config(self, model: nn.Module):
        """The checkpoint's config when `model` is the text model inside it, else None."""
        # lazy: transformers, 0.9 s of import
        from transformers import AutoConfig

        try:
            stored = json.loads((self.root / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return None
        if stored is None or stored == getattr(model.config, "model_type", stored):
            return None
        whole = AutoConfig.from_pretrained(self.root)
        return whole if is_text_model_of(whole) else None

    def _sources(
        self, model: nn.Module, only: set[str] | None
    ) -> Iterator[tuple[str, StoredTensor | Computed]]:
        # lazy: transformers, 0.9 s of import
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        known = dict.fromkeys(state_names(model), True)
        prefix = getattr(model, "base_model_prefix", None) or None
        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        groups: dict[str, WeightConverter] = {}
        for key in sorted(self.tensors, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, known)
            if name not in known or (only is not None and name not in only):
                continue  # transformers ignores it too (e.g. an old rotary inv_freq)
            if pattern is None:
                yield name, self.tensors[key]
                continue
            if name not in groups:
                template = by_pattern[pattern]
                groups[name] = WeightConverter(
                    source_patterns=template.source_patterns,
                    target_patterns=template.target_patterns,
                    operations=template.operations,
                )
            groups[name].add_tensor(name, key, pattern, functools.partial(self._full, key))
        for name, group in groups.items():
            converted = group.convert(name, model=model, config=model.config)
            for out_name, value in converted.items():
                value = value[0] if isinstance(value, list) else value
                if prefix and f"{prefix}.{out_name}" in known:
                    out_name = f"{prefix}.{out_name}"
                yield out_name, Computed(value)
            del converted

    def _full(self, key: str) -> torch.Tensor:
        return self.tensors[key].full()


def fill_plan(
    model: nn.Module, weights: TargetWeights
) -> Iterator[tuple[str, nn.Parameter | torch.Tensor, StoredTensor | Computed]]:
    """(name, the parameter or buffer, its source) for everything of `model` the checkpoint
    holds, each shared parameter once; ConfigError names the first parameter it does not hold
    (after the others were yielded) or one stored in another shape than the model's (a ZeRO-3
    parameter's full shape is its `ds_shape`)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    done: set[int] = set()
    for name, source in weights.sources(model):
        tensor = params.get(name, buffers.get(name))
        if tensor is None or id(tensor) in done:
            continue
        want = tuple(getattr(tensor, "ds_shape", tensor.shape))
        if tuple(source.shape) != want:
            raise ConfigError(
                f"target.path: {name} is stored as {tuple(source.shape)} in {weights.root}, "
                f"the model's config makes it {want}"
            )
        done.add(id(tensor))
        yield name, tensor, source
    missing = [name for name, p in params.items() if id(p) not in done]
    if missing:
        raise ConfigError(
            f"target.path: {weights.root} holds no value for {missing[0]} "
            f"({len(missing)} parameters missing)"
        )
