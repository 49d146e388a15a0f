"""A real vLLM server writing a tiny target's hidden states (`dspark-ds serve-target`), on loopback.

    with ServedTarget(target_dir, storage, layer_ids=[-1, 1, 3], log=tmp / "vllm.log") as server:
        answer = server.extract(token_ids)            # POST /v1/completions, max_tokens 1
        tensors, meta = read_hidden_states(answer["kv_transfer_params"]["hidden_states_path"])
        # tensors["hidden_states"] [T, k, H] (vLLM aux ids = ServedLayout(layer_ids, L).aux_ids),
        # tensors["token_ids"] [T]; meta: the connector's safetensors metadata

- ``ServedTarget(target_dir, storage, layer_ids, log, port=None, extra_env=None, *,
  max_length=511, vllm_args=("--max-num-seqs", "8"), via_cli=False)``: vLLM's CPU build serving
  ``target_dir`` in float32 with the project's connector writing to ``storage``, the argv and
  environment made by `dspark_ds.serve.target_server.build_command` (``--max-model-len``
  ``max_length + 1``, ``--enforce-eager``, 1 GiB of KV cache; ``vllm_args`` appended), in its own
  process group, ready once ``/health`` answers; leaving the block kills the whole group and
  waits for it. ``port``: None = a free one. ``extra_env``: added to the server's environment
  (``OPENAI_API_KEY`` in it makes the server key-protected; it is removed from the environment
  otherwise). ``via_cli``: started as ``python -m dspark_ds.cli serve-target --config tiny_cpu
  ...`` instead (the command itself, which forwards SIGTERM to vLLM's group); ``exit_code`` is
  then its exit code once the block is left.
  Attributes: ``url`` (``http://127.0.0.1:PORT``, no ``/v1``), ``port``, ``model`` (the name to
  send: the target's path), ``storage``, ``layout`` (`ServedLayout`), ``config`` (the
  `ServeTargetConfig`), ``start_s`` (seconds to ready), ``log``; ``environment()``: the
  environment the server starts from (this one, less ``OPENAI_API_KEY``, plus ``extra_env``).
- ``server.extract(ids, key=None) -> dict``: the completion's JSON for prompt ``ids``
  (``max_tokens`` 1, ``return_token_ids``).
- ``server.metric(name) -> float``: a counter of its ``/metrics`` (summed over its labels).
- ``read_hidden_states(path, timeout_s=30) -> (tensors, metadata)``: a file once its writer let
  go of ``<path>.lock`` (the stock connector's protocol; the answer comes before the file is
  written).

vLLM not installed: the test fails naming the install command (`require_vllm`). One start takes
30-60 s on 2 cores: share a server across a module's tests. NOTE: vLLM's CPU attention takes
heads of 32 and more: build the target with ``build_tiny_target(dir, hidden_size=128)``; the
session's ``tiny_target`` (head size 8) starts, then its engine dies at the first request
(HTTP 500, "Unsupported CPU attention configuration: head_dim=8").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from dspark_ds.data.config import DataConfig, ServedConfig
from dspark_ds.serve.hidden_states import ServedLayout
from dspark_ds.serve.target_server import ServeTargetConfig, build_command, served_layout
from dspark_ds.target import TargetConfig

from helpers.vllm_serving import VllmServer, _group_alive, require_vllm


class ServedTarget(VllmServer):
    def __init__(
        self,
        target_dir,
        storage,
        layer_ids,
        log: Path,
        port: int | None = None,
        extra_env: dict | None = None,
        *,
        max_length: int = 511,
        vllm_args=("--max-num-seqs", "8"),
        via_cli: bool = False,
    ):
        super().__init__(target_dir, log=Path(log))
        if port is not None:
            self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.model = str(target_dir)
        self.storage = Path(storage).absolute()
        self.layer_ids = list(layer_ids)
        self.extra_env = dict(extra_env or {})
        self.max_length = max_length
        self.vllm_args = [str(a) for a in vllm_args]
        self.via_cli = via_cli
        self.exit_code: int | None = None
        self.config = ServeTargetConfig(
            target=TargetConfig(
                path=self.model, layer_ids=self.layer_ids, dtype="float32", device="cpu"
            ),
            data=DataConfig(max_length=max_length, served=ServedConfig(vllm_args=self.vllm_args)),
            host="127.0.0.1",
            port=self.port,
            storage=str(self.storage),
        )
        self.layout: ServedLayout = served_layout(self.config.target)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("OPENAI_API_KEY", None)  # key-protected only when extra_env says so
        env.update(self.extra_env)
        return env

    def _cli_argv(self, python: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "dspark_ds.cli",
            "serve-target",
            "--config",
            "tiny_cpu",
            "--target.path",
            self.model,
            "--target.layer_ids",
            json.dumps(self.layer_ids),
            "--target.dtype",
            "float32",
            "--target.device",
            "cpu",
            "--data.max_length",
            str(self.max_length),
            "--data.served.vllm_args",
            json.dumps(self.vllm_args),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--storage",
            str(self.storage),
            "--vllm_python",
            python,
        ]

    def __enter__(self) -> ServedTarget:
        python = require_vllm()
        base = self.environment()
        if self.via_cli:
            argv, env = self._cli_argv(python), base
        else:
            cmd = build_command(self.config, python=python, cuda=False, environ=base)
            argv, env = cmd.argv, cmd.environ(base)
            self.storage.mkdir(parents=True, exist_ok=True)
        return self._launch(argv, env)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        if not self.via_cli:
            super().__exit__(*exc)
            return
        proc, vllm_pgid = self.proc, self._vllm_group()
        try:
            proc.send_signal(signal.SIGTERM)  # serve-target forwards it to vLLM's group
            self.exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        finally:
            super().__exit__(*exc)  # serve-target's own group, if it is still there
            if vllm_pgid is not None and _group_alive(vllm_pgid):
                os.killpg(vllm_pgid, signal.SIGKILL)

    def _vllm_group(self) -> int | None:
        """vLLM's process group, as serve-target printed it."""
        found = re.search(r"vLLM pid \d+ \(process group (\d+)\)", self.log.read_text())
        return int(found.group(1)) if found else None

    def extract(self, ids: list[int], key: str | None = None) -> dict:
        body = {"model": self.model, "prompt": list(ids), "max_tokens": 1, "return_token_ids": True}
        return self.completions(body, key)

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples on ``/metrics`` (a counter: ``vllm:prefix_cache_hits``)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        sample = re.compile(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", re.M)
        return sum(float(v) for v in sample.findall(text))


def read_hidden_states(path: str | Path, timeout_s: float = 30.0) -> tuple[dict, dict]:
    """(tensors, safetensors metadata) of a connector's file, once its writer released
    ``<path>.lock`` (the trainer's own wait, `dspark_ds.data.served.wait_for_file`)."""
    from safetensors import safe_open

    from dspark_ds.data.served import wait_for_file

    wait_for_file(Path(path), timeout_s)
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
