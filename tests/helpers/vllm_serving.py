"""A real vLLM server on loopback, and tiny drafters trained for it (tests/e2e/test_serving_vllm.py).

- ``require_vllm() -> str``: the Python of the vLLM environment ``tools/install.sh`` makes (or
  ``$DSPARK_DS_VLLM_PYTHON``); fails the test, naming the install command, when there is none.
- ``VllmServer(target, speculative=None, api_key=None, log=...)``: ``python -m
  vllm.entrypoints.openai.api_server`` of vLLM's CPU build (float32, eager, 1 GiB KV cache,
  max_model_len 512) started in its own process group, ready once ``/health`` answers; leaving
  the block kills the whole group (API server, engine core, worker) and waits for it.
- ``tiny_prompts(target_dir, n)`` / ``train_tiny_drafter(target, model, prompts, steps)``: the
  target's own greedy answers to chat-templated prompts, and a drafter trained on them a few
  steps with its kind's training step (the trainer's, in process: what is tested is the format
  and the parity, not the quality).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from dspark_ds.distributed import free_port
from dspark_ds.serve.check import vllm_env, vllm_python

from helpers.system import INSTALL, wait_healthy

START_TIMEOUT_S = 420.0


def require_vllm() -> str:
    python = vllm_python()
    if python is None:
        pytest.fail(
            f"vLLM not installed: run `{INSTALL}` (it makes the vLLM environment, "
            "~/.cache/dspark-ds/vllm-venv; or set DSPARK_DS_VLLM_PYTHON)",
            pytrace=False,
        )
    return python


class VllmServer:
    def __init__(
        self, target, *, speculative: dict | None = None, api_key: str | None = None, log: Path
    ):
        self.target, self.speculative, self.api_key, self.log = (
            str(target),
            speculative,
            api_key,
            log,
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    def __enter__(self) -> VllmServer:
        argv = [require_vllm(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.target]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32"]
        argv += ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8"]
        if self.speculative:
            argv += ["--speculative-config", json.dumps(self.speculative)]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        env = vllm_env(cuda=False)
        env.pop("OPENAI_API_KEY", None)  # the server's key comes from --api-key only
        return self._launch(argv, env)

    def _launch(self, argv: list[str], env: dict) -> VllmServer:
        """Starts ``argv`` in its own process group, logging to ``self.log``; returns once
        ``/health`` answers (the group killed if it does not)."""
        t0 = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _wait_ready(self) -> None:
        if wait_healthy(f"{self.url}/health", self.proc, START_TIMEOUT_S, poll_s=1.0, request_s=5):
            return
        if self.proc.poll() is not None:
            tail = self.log.read_text().strip().splitlines()[-15:]
            raise RuntimeError(f"vLLM server exited {self.proc.returncode}:\n" + "\n".join(tail))
        raise TimeoutError(f"vLLM server not ready after {START_TIMEOUT_S:g} s ({self.log})")

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # the group's other members (engine core, worker) may outlive the API server
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                time.sleep(0.2)
            if not _group_alive(self.proc.pid):
                break
        self.proc = None

    def completions(self, body: dict, key: str | None = None) -> dict:
        """The server's answer to ``body`` on /v1/completions (``key``: the bearer token)."""
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def complete(self, prompt_ids: list[int], max_tokens: int, key: str | None = None) -> list[int]:
        body = {
            "model": self.target,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        return self.completions(body, key)["choices"][0]["token_ids"]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- tiny drafters ---------------------------------------------------------------------------
def tiny_prompts(tokenizer, n: int, seed: int = 0) -> list[list[str]]:
    """`n` one-turn prompts of a few words (the benchmarks' {"turns": [...]} rows)."""
    g = torch.Generator().manual_seed(seed)
    words = ["cat", "sky", "blue", "seven", "apple", "river", "stone", "green", "moon", "salt"]
    rows = []
    for _ in range(n):
        picks = torch.randint(0, len(words), (4,), generator=g).tolist()
        rows.append([" ".join(words[i] for i in picks)])
    return rows


@torch.no_grad()
def greedy_sequences(target, tokenizer, rows, max_new_tokens: int):
    """(input_ids [1, L] of prompt + the target's greedy answer, the prompt length) per row."""
    from dspark_ds.eval.benchmarks import encode_prompt
    from dspark_ds.eval.decoding import target_generate
    from dspark_ds.eval.runner import stop_token_ids

    stops = stop_token_ids(target, tokenizer)
    out = []
    for turns in rows:
        prompt = encode_prompt(tokenizer, turns, {"enable_thinking": False})
        full = target_generate(target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        out.append((full, prompt.shape[1]))
    return out


def train_tiny_drafter(
    target,
    model_cfg,
    sequences,
    *,
    layer_ids,
    mask_token_id,
    steps: int,
    seed: int = 0,
    lr: float = 3e-3,
):
    """A drafter of `model_cfg` (a DrafterConfig) trained `steps` Adam steps on `sequences`
    (`greedy_sequences`), one sequence per step, features from the target; in eval mode."""
    from dspark_ds.drafters import build_draft_model
    from dspark_ds.drafters.kind import StepContext
    from dspark_ds.drafters.perf import PerfConfig
    from dspark_ds.drafters.registry import get_kind
    from dspark_ds.target import FrozenTarget

    kind = get_kind(model_cfg.kind)
    torch.manual_seed(seed)
    config = kind.build_config(
        target.config, model_cfg, target_layer_ids=layer_ids, mask_token_id=mask_token_id
    )
    drafter = build_draft_model(config)
    drafter.initialize_embeddings_and_head(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    perf = PerfConfig()
    ctx = StepContext(model_cfg, perf, kind.train.prepare(drafter, perf, "cpu"), seed=seed)
    tapped = FrozenTarget(target, layer_ids)
    batches = []
    for i, (ids, prompt_len) in enumerate(sequences):
        hidden, last = tapped(ids)
        mask = torch.zeros_like(ids, dtype=torch.float32)
        mask[:, prompt_len:] = 1.0
        batches.append(
            dict(
                input_ids=ids,
                target_hidden_states=hidden,
                loss_mask=mask,
                target_last_hidden_states=last,
                sample_ids=torch.tensor([i]),
            )
        )
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    drafter.train()
    for step in range(steps):
        batch = batches[step % len(batches)]
        out = kind.train.training_step(drafter, batch, dataclasses.replace(ctx, epoch=step))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval()
