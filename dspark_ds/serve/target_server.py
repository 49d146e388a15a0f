"""`dspark-ds serve-target`: vLLM serving a recipe's target, writing for every completion request
the tapped hidden states that `data.mode: served` trains on (docs/serving.md#serve-target).

    dspark-ds serve-target --config RECIPE --port 8000 --storage /shared/hidden
    dspark-ds serve-target --config tiny_cpu --storage /tmp/hs --dry_run true   # print only

RECIPE is the `dspark-ds train` recipe (a YAML path or a shipped recipe's name); what it reads:
``target.path`` / ``dtype`` / ``layer_ids`` / ``revision`` / ``trust_remote_code`` /
``device``, ``data.max_length`` and ``data.served`` (connector, tensor / expert parallelism,
more vLLM flags, the API key's variable). It prints the equivalent shell command (for sites that
start vLLM themselves), creates the storage directory, then runs vLLM in the foreground in its
own process group: SIGTERM and SIGINT go to that group (a second one kills it), and the command
exits with vLLM's code.

vLLM runs in its own Python (`check.vllm_python`: ``--vllm_python``, ``$DSPARK_DS_VLLM_PYTHON``,
this interpreter when it imports vllm, the environment ``tools/install.sh`` makes). Off a GPU
(``target.device`` cpu, or no CUDA in this Python) the CPU build's environment
(`check.vllm_env`) and ``--enforce-eager`` are added. The project's connector
(``data.served.connector`` left at its default) is the module in ``vllm_connector/``, put on
vLLM's PYTHONPATH.

NOTE: the process runs ``python -m vllm.entrypoints.openai.api_server --model <target>`` (the
parser of ``vllm serve``): the CPU build's ``vllm`` command and ``vllm.entrypoints.cli.main``
stop at start (no package metadata named vllm). The printed command is ``vllm serve``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_ds.config import TrainRunConfig
from dspark_ds.data.config import CONNECTOR, ServedConfig
from dspark_ds.drafters.common.target_config import text_config, validate_layer_ids
from dspark_ds.errors import ConfigError
from dspark_ds.serve.check import vllm_env, vllm_python
from dspark_ds.serve.hidden_states import ServedLayout, speculative_config
from dspark_ds.target import TargetConfig, default_layer_ids, target_model_config

CONNECTOR_DIR = Path(__file__).resolve().parent / "vllm_connector"
"""The folder vLLM's Python finds the project's connector in (on its PYTHONPATH)."""
CONNECTOR_MODULE = "shared_storage_hidden_states"
"""vLLM's ``kv_connector_module_path`` of the project's connector."""
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass
class ServeTargetConfig(TrainRunConfig):
    """Starts vLLM serving a train recipe's target, with its tapped layers written to storage."""

    host: str = "0.0.0.0"
    """Address vLLM listens on."""
    port: int = 8000
    """Port vLLM listens on."""
    storage: str | None = None
    """Directory the connector writes the hidden-state files to (created); None =
    data.served.storage. The trainers read it under the same file names."""
    dry_run: bool = False
    """Print the command and start nothing."""
    vllm_python: str | None = None
    """Python with vLLM installed; None = $DSPARK_DS_VLLM_PYTHON, this interpreter when it imports
    vllm, else the environment tools/install.sh makes."""

    def validate(self) -> ServeTargetConfig:
        """What serving needs (no data.paths: the trainers send the sequences)."""
        if not self.target.path:
            raise ConfigError("target.path: is required (the model vLLM serves)")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"port: must be in 1..65535, got {self.port}")
        if not (self.storage or self.data.served.storage):
            raise ConfigError(
                "storage: is required (the directory the server writes hidden states to; "
                "or data.served.storage)"
            )
        return self

    @property
    def storage_dir(self) -> str:
        """The storage directory as an absolute path (vLLM writes relative to its own cwd)."""
        return os.path.abspath(os.path.expanduser(self.storage or self.data.served.storage))


@dataclass(frozen=True)
class ServeCommand:
    """The vLLM process `serve-target` runs, and the same as a shell command."""

    argv: list[str]
    """``<vllm python> -m vllm.entrypoints.openai.api_server --model <target> ...``."""
    env: dict[str, str]
    """Variables set for vLLM on top of this process's environment (printed)."""
    layout: ServedLayout
    """What the server taps."""
    api_key_env: str | None = None
    """The variable whose value vLLM gets as its API key (`VLLM_API_KEY`, never in argv)."""

    @property
    def shell(self) -> str:
        """``VAR=... vllm serve <target> <flags>``, copy-pasteable; the key as ``"$VAR"``."""
        words = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        words += ["vllm", "serve", *map(shlex.quote, self.argv[self.argv.index("--model") + 1 :])]
        if self.api_key_env:
            words += ["--api-key", f'"${self.api_key_env}"']
        return " ".join(words)

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """vLLM's whole environment: ``base`` (default: this process's), ``env`` (PYTHONPATH
        prepended to base's) and the API key as ``VLLM_API_KEY``."""
        base = os.environ if base is None else base
        env = dict(base)
        for key, value in self.env.items():
            if key == "PYTHONPATH" and env.get(key):
                value = f"{value}{os.pathsep}{env[key]}"
            env[key] = value
        if self.api_key_env:
            env["VLLM_API_KEY"] = base[self.api_key_env]
        return env


def served_layout(target: TargetConfig) -> ServedLayout:
    """The target's layer count read from its config (ConfigError naming target.path), and
    target.layer_ids checked against it (None = `default_layer_ids`)."""
    num_layers = int(text_config(target_model_config(target)).num_hidden_layers)
    ids = target.layer_ids if target.layer_ids is not None else default_layer_ids(num_layers)
    ids = validate_layer_ids(ids, num_layers, field="target.layer_ids")
    return ServedLayout(tuple(ids), num_layers)


def kv_transfer_config(served: ServedConfig, storage: str) -> dict:
    """vLLM's ``--kv-transfer-config``: the connector writing to ``storage``."""
    if "shared_storage_path" in served.connector_extra:
        raise ConfigError(
            "data.served.connector_extra: shared_storage_path is set by --storage "
            "(data.served.storage); remove it"
        )
    config = {
        "kv_connector": served.connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {**served.connector_extra, "shared_storage_path": storage},
    }
    module = served.connector_module or (
        CONNECTOR_MODULE if served.connector == CONNECTOR else None
    )
    if module:
        config["kv_connector_module_path"] = module
    return config


def build_command(
    cfg: ServeTargetConfig, *, python: str, cuda: bool, environ: Mapping[str, str] | None = None
) -> ServeCommand:
    """The vLLM server of ``cfg`` run by ``python``: on a GPU when ``cuda``, else with the CPU
    build's settings; ``environ`` (default: this process's) is the environment it starts from
    (what it lacks of the CPU settings is added; whether it holds the API key)."""
    environ = os.environ if environ is None else environ
    layout = served_layout(cfg.target)
    served = cfg.data.served
    kv = kv_transfer_config(served, cfg.storage_dir)
    options = [
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--dtype",
        cfg.target.dtype,
        "--max-model-len",
        str(cfg.data.max_length + 1),  # the sequence and the one sampled token
        "--speculative-config",
        json.dumps(speculative_config(layout)),
        "--kv-transfer-config",
        json.dumps(kv),
        "--tensor-parallel-size",
        str(served.tensor_parallel_size),
    ]
    if served.model:
        options += ["--served-model-name", served.model]
    if cfg.target.revision:
        options += ["--revision", cfg.target.revision]
    if cfg.target.trust_remote_code:
        options.append("--trust-remote-code")
    if served.expert_parallel:
        options.append("--enable-expert-parallel")
    if not cuda:
        options.append("--enforce-eager")
    options += [str(a) for a in served.vllm_args]  # last: they override the flags above
    added = {k: v for k, v in vllm_env(cuda).items() if os.environ.get(k) != v}
    if any(str(a).startswith("--kv-cache-memory-bytes") for a in served.vllm_args):
        # NOTE: the CPU build's legacy VLLM_CPU_KVCACHE_SPACE wins over the flag when set
        added.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env = {k: v for k, v in added.items() if k not in environ}
    if kv.get("kv_connector_module_path") == CONNECTOR_MODULE:
        env["PYTHONPATH"] = str(CONNECTOR_DIR)
    key_env = served.api_key_env if environ.get(served.api_key_env) else None
    return ServeCommand(
        argv=[python, "-m", SERVER_MODULE, "--model", cfg.target.path, *options],
        env=env,
        layout=layout,
        api_key_env=key_env,
    )


def uses_cuda(device: str | None) -> bool:
    """target.device → whether vLLM runs on a GPU (None: when this Python's torch sees one)."""
    if device:
        return device.startswith("cuda")

    return torch.cuda.is_available()


def run_serve_target(cfg: ServeTargetConfig) -> None:
    python = vllm_python(cfg.vllm_python)
    cuda = uses_cuda(cfg.target.device)
    cmd = build_command(cfg, python=python or "python", cuda=cuda)
    if python is None and not cfg.dry_run:
        raise ConfigError(
            "vllm_python: no Python with vLLM found (`bash tools/install.sh` makes one, or set "
            "--vllm_python / $DSPARK_DS_VLLM_PYTHON)"
        )
    layout = cmd.layout
    print(
        f"[serve-target] {cfg.target.path} ({layout.num_layers} layers) on "
        f"{'GPU' if cuda else 'CPU'}: target.layer_ids {list(layout.layer_ids)} = vLLM aux ids "
        f"{layout.aux_ids}; files in {cfg.storage_dir}",
        flush=True,
    )
    print(f"[serve-target] {cmd.shell}", flush=True)
    if cfg.dry_run:
        return
    os.makedirs(cfg.storage_dir, exist_ok=True)
    code = run_foreground(cmd.argv, cmd.environ())
    if code:
        raise SystemExit(code)


def run_foreground(argv: list[str], env: dict[str, str], stop_wait_s: float = 30.0) -> int:
    """Runs ``argv`` in a process group of its own until it exits; SIGTERM and SIGINT received
    meanwhile go to that group (a second one: SIGKILL). Its exit code (128 + N when signal N
    ended it); what is left of its group ``stop_wait_s`` later is killed."""
    received: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        if proc is not None:
            _signal_group(proc.pid, signum if len(received) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        print(f"[serve-target] vLLM pid {proc.pid} (process group {proc.pid})", flush=True)
        if received:  # a signal that came while it started
            _signal_group(proc.pid, received[0])
        code = None
        while code is None:
            # NOTE: not one blocking wait: a signal the kernel hands to another thread of this
            # process would not interrupt it, and Python runs its handler in this thread only
            # when it runs bytecode again
            try:
                code = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc is not None:
            _reap_group(proc.pid, stop_wait_s)
    return code if code >= 0 else 128 - code


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: a container's init
    may never reap the children a process left behind."""
    procfs = Path("/proc")
    if not procfs.is_dir():
        return _signal_group(pgid, 0)
    for stat in procfs.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        if state != "Z" and int(pgrp) == pgid:
            return True
    return False


def _reap_group(pgid: int, wait_s: float) -> None:
    """The group's other members (vLLM's engine core, its workers) once its leader exited."""
    if not group_running(pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and group_running(pgid):
        time.sleep(0.2)
    _signal_group(pgid, signal.SIGKILL)
