"""`dspark-ds serve-check`: will the engines serve this drafter directory as it is?

    dspark-ds serve-check --drafter runs/dflash/export --target.path Qwen/Qwen3-8B

1. dspark-ds reads the directory (a damaged file or a missing config key: one line naming it)
   and prints its engine format, the vLLM and SGLang commands, and what an engine will do
   differently (drafters/serving.py).
2. vLLM's own config validation and weight loader, in vLLM's Python (`vllm_probe.py load`):
   the drafter as `speculative_config` of the target, then its vLLM model class given every
   tensor of the directory: nothing missing, nothing unexpected.
3. With `--generate true`: a vLLM engine with the drafter, greedy completions of a few token-id
   prompts and its speculative-decoding counters (`vllm_probe.py generate`; DFlash and Eagle3 on
   vLLM's CPU build too, DSpark in vLLM's V2 runner on a GPU).

Which Python has vLLM: `--vllm_python`, else `$DSPARK_DS_VLLM_PYTHON`, else this interpreter
when it imports vllm (a GPU node's own install), else the environment `tools/install.sh` makes
(`$DSPARK_DS_VLLM_ENV`, default ~/.cache/dspark-ds/vllm-venv).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dspark_ds.drafters.io import (
    config_from_dict,
    draft_config_dict,
    read_config_dict,
    read_state_dict,
)
from dspark_ds.drafters.serving import serving_format
from dspark_ds.drafters.speculators_format import is_speculators
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_exists
from dspark_ds.target import TargetPathConfig
from dspark_ds.target_checkpoint import read_target_config

PROBE = Path(__file__).resolve().parent / "vllm_probe.py"
DEFAULT_VLLM_ENV = Path("~/.cache/dspark-ds/vllm-venv")


def vllm_python(explicit: str | None = None) -> str | None:
    """The Python interpreter that imports vLLM (module docstring), or None."""
    if explicit:
        return explicit
    if os.environ.get("DSPARK_DS_VLLM_PYTHON"):
        return os.environ["DSPARK_DS_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    env = Path(os.environ.get("DSPARK_DS_VLLM_ENV") or DEFAULT_VLLM_ENV).expanduser()
    python = env / "bin" / "python"
    return str(python) if python.exists() else None


def vllm_env(cuda: bool, v2_runner: bool = False) -> dict:
    """The environment of a vLLM process: the CPU build's settings off a GPU (1 GiB of KV
    cache unless set), the V2 runner for a format only it runs (`ServingFormat.vllm_v2_runner`)."""
    env = dict(os.environ)
    if not cuda:
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if v2_runner and cuda:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return env


def run_probe(
    python: str, args: list[str], *, cuda: bool, v2_runner: bool, timeout_s: float
) -> dict:
    """`vllm_probe.py <args>` in vLLM's Python; its result (ConfigError when it gave none)."""
    argv = [python, str(PROBE), *args]
    try:
        proc = subprocess.run(
            argv, env=vllm_env(cuda, v2_runner), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"vllm_python {python}: the probe ran past {timeout_s:g} s") from None
    except OSError as err:
        raise ConfigError(f"vllm_python {python}: cannot run it ({err})") from None
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_PROBE "):
            return json.loads(line[len("VLLM_PROBE ") :])
    tail = [x for x in proc.stderr.strip().splitlines() if x.strip()][-1:] or ["no output"]
    raise ConfigError(f"vllm_python {python}: exit {proc.returncode}: {tail[0][:300]}")


@dataclass
class ServeCheckConfig:
    """Checks that vLLM (and SGLang) serve a drafter directory as written (docs/serving.md)."""

    drafter: str = ""
    """The drafter directory (what `dspark-ds export` or training wrote)."""
    target: TargetPathConfig = field(default_factory=TargetPathConfig)
    """The target it drafts for (target.path: a local directory or hub id)."""
    vllm_python: str | None = None
    """Python with vLLM installed; None = the search order of the module docstring."""
    generate: bool = False
    """Also start a vLLM engine with the drafter and decode a few prompts greedily."""
    device: str = "auto"
    """For --generate: cuda | cpu | auto (cuda when torch sees a GPU)."""
    num_prompts: int = 2
    """Random token-id prompts of --generate."""
    max_new_tokens: int = 16
    timeout_s: float = 900.0
    """Longest a vLLM probe may run."""

    def __post_init__(self) -> None:
        if not self.drafter:
            raise ConfigError("drafter: is required (a drafter directory)")
        if not self.target.path:
            raise ConfigError("target.path: is required (the target the drafter serves with)")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"device: auto, cuda or cpu, got {self.device!r}")


def describe(drafter_dir: str, target_path: str) -> tuple[dict, object]:
    """Our side: the directory read (one line naming a damaged file) and its ServingFormat."""
    check_exists(drafter_dir, "drafter", "drafter directory")
    target_config = read_target_config(target_path)
    path = Path(drafter_dir)
    data = read_config_dict(path)
    try:
        config = config_from_dict(data, target_config)
    except ConfigError as err:
        raise ConfigError(f"{path / 'config.json'}: {err}") from None
    read_state_dict(path)  # every weights file readable
    native = {**draft_config_dict(config), "architectures": list(config.architectures)}
    fmt = serving_format(native)
    if fmt is None:
        raise ConfigError(f"{path / 'config.json'}: {config.architectures[0]} has no engine format")
    if is_speculators(data) and fmt.sglang_algorithm is not None:
        note = (
            "a speculators checkpoint: vLLM reads it as it is; the SGLang command is for the "
            "engine format (dspark-ds export --format native), SGLang's reading of this one is "
            "not checked here"
        )
        fmt = replace(fmt, warnings=(*fmt.warnings, note))
    return native, fmt


def run_serve_check(cfg: ServeCheckConfig) -> dict:
    native, fmt = describe(cfg.drafter, cfg.target.path)
    print(
        f"[serve-check] {cfg.drafter}: {fmt.name} ({fmt.architecture}), "
        f"{fmt.num_speculative_tokens} draft tokens a round"
    )
    for engine, command in (
        ("vLLM", fmt.vllm_command(cfg.target.path, cfg.drafter)),
        ("SGLang", fmt.sglang_command(cfg.target.path, cfg.drafter)),
    ):
        print(f"[serve-check] {engine}: {command or 'does not serve this format'}")
    for warning in fmt.warnings:
        print(f"[serve-check] NOTE: {warning}")
    if fmt.vllm_method is None:
        raise ConfigError(f"drafter: vLLM cannot serve {cfg.drafter} ({'; '.join(fmt.warnings)})")
    python = vllm_python(cfg.vllm_python)
    if python is None:
        raise ConfigError(
            "vllm_python: no Python with vLLM found (`bash tools/install.sh` makes one, or "
            "set --vllm_python / $DSPARK_DS_VLLM_PYTHON)"
        )

    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    args = [cfg.target.path, cfg.drafter, fmt.vllm_method, str(fmt.num_speculative_tokens)]
    loaded = run_probe(
        python,
        ["load", *args, fmt.vllm_block_mask or ""],
        cuda=cuda,
        v2_runner=fmt.vllm_v2_runner,
        timeout_s=cfg.timeout_s,
    )
    version = loaded.get("vllm_version", "?")
    if not loaded.get("ok"):
        what = loaded.get("error") or f"missing {loaded.get('missing')}"
        raise ConfigError(f"drafter: vLLM {version} refuses {cfg.drafter}: {what}")
    if loaded.get("loader") is False:  # the platform only stubs the model class
        print(f"[serve-check] vLLM {version}: config valid; not checked: {loaded['skipped']}")
    else:
        print(
            f"[serve-check] vLLM {version}: config valid, {loaded['model_class']} took all "
            f"{loaded['tensors']} tensors, none missing"
            + (f" ({loaded['skipped']})" if loaded.get("skipped") else "")
        )
    if loaded.get("draft_attention") == "causal":  # our DSpark / DFlash blocks: bidirectional
        print(
            f"[serve-check] NOTE: vLLM {version} reads {cfg.drafter} as drafting with causal "
            "blocks (its dflash_config.causal); dspark-ds trains and decodes them bidirectional: "
            "the outputs stay the target's, the acceptance is not ours (a speculators "
            "config.json: set sliding_window_non_causal true, which vLLM reads for every layer)"
        )
    result = {"format": fmt.name, "vllm_method": fmt.vllm_method, "load": loaded}
    if cfg.generate:
        if fmt.vllm_v2_runner and not cuda:
            raise ConfigError(
                f"generate: vLLM runs {fmt.vllm_method!r} in its V2 model runner only, which "
                "needs Triton and a GPU"
            )
        g = torch.Generator().manual_seed(0)
        vocab = int(native["vocab_size"])
        prompts = [
            torch.randint(0, vocab - 1, (12,), generator=g).tolist() for _ in range(cfg.num_prompts)
        ]
        ran = run_probe(
            python,
            ["generate", *args, json.dumps(prompts), str(cfg.max_new_tokens)],
            cuda=cuda,
            v2_runner=fmt.vllm_v2_runner,
            timeout_s=cfg.timeout_s,
        )
        if not ran.get("ok"):
            raise ConfigError(f"generate: vLLM {version} could not run it: {ran.get('error')}")
        counters = ran["counters"]
        drafts = counters.get("vllm:spec_decode_num_drafts", 0) or 0
        accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0) or 0
        tau = 1 + accepted / drafts if drafts else float("nan")
        print(f"[serve-check] vLLM decoded {len(prompts)} prompts: {drafts} drafts, τ {tau:.2f}")
        result.update(generate=ran, prompts=prompts)
    return result
