"""The demo's target: a tiny Qwen3 trained on the synthetic corpus, cached on disk.

`ensure_demo_target(cfg)` returns a directory that loads like any downloaded model
(`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`). The first call
trains the tokenizer and the model (a few minutes on 2 CPU cores); later calls with the
same corpus, tokenizer, model and training settings reuse the cached directory.

Cache: `$DSPARK_DS_CACHE` or `~/.cache/dspark-ds`, then `targets/<name>-<hash>/`. The hash
covers the corpus text, the tokenizer and model configs and the training settings, so
any change that would give a different model trains a new one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dspark_ds.data.synthetic import Row, make_corpus
from dspark_ds.demo.tokenizer import IM_END, PAD_TOKEN, train_tokenizer
from dspark_ds.errors import ConfigError, require_at_least_one

REPORT_FILE = "demo_target.json"
# Bump when the training recipe changes in a way the config fields do not capture.
RECIPE_VERSION = 1


@dataclass
class DemoTargetConfig:
    """Corpus, tokenizer, model and training budget of the demo target."""

    seed: int = 0
    """Seed of the corpus, the weight init and the batch order."""
    num_train_rows: int = 6000
    """Synthetic conversations the tokenizer and the target are trained on."""
    vocab_size: int = 1024
    """BPE vocabulary size, special tokens included."""
    hidden_size: int = 128
    """Target hidden size (the drafters share it)."""
    num_hidden_layers: int = 5
    """Target decoder layers."""
    num_attention_heads: int = 4
    """Query heads; head_dim = hidden_size / num_attention_heads."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA, like Qwen3)."""
    intermediate_size: int = 384
    """MLP width."""
    max_steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 16
    """Conversations per step (padded to the longest in the batch)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    num_probe_rows: int = 128
    """Fresh conversations (seed + 1) on which the trained target's entropy is reported."""
    num_threads: int | None = None
    """torch CPU threads while training; None = all cores, at most 4. Not part of the key.

    NOTE: on a machine that other jobs keep busy, 1 thread can be ~10x faster than 2: torch's
    worker threads spin waiting for each other while the OS runs someone else."""
    cache_dir: str | None = None
    """Cache root; None = $DSPARK_DS_CACHE, else ~/.cache/dspark-ds. Not part of the key."""

    def __post_init__(self) -> None:
        require_at_least_one(
            self,
            (
                "num_train_rows",
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "max_steps",
                "batch_size",
            ),
            "target.",
        )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"target.hidden_size: {self.hidden_size} is not divisible by "
                f"target.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"target.num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"target.num_attention_heads={self.num_attention_heads}"
            )
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ConfigError(
                f"target.lr / target.warmup_steps: need lr > 0 and warmup_steps >= 0, "
                f"got {self.lr} / {self.warmup_steps}"
            )


@dataclass
class DemoTarget:
    """A ready target directory and how it was obtained."""

    path: Path
    """HF model directory (config, safetensors, tokenizer, `demo_target.json`)."""
    from_cache: bool
    """True when an earlier run had trained it."""
    report: dict[str, Any] = field(default_factory=dict)
    """Training report: final loss, loss curve, seconds, parameter count, entropy."""


def cache_root(cfg: DemoTargetConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("DSPARK_DS_CACHE") or "~/.cache/dspark-ds"
    return Path(root).expanduser()


def _cache_key(cfg: DemoTargetConfig, rows: list[Row]) -> str:
    fields = asdict(cfg)
    fields.pop("num_threads")
    fields.pop("cache_dir")
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": RECIPE_VERSION, **fields}, sort_keys=True).encode())
    for row in rows:
        h.update(json.dumps(row, sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_model_config(cfg: DemoTargetConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=im_end,
        bos_token_id=None,
    )


def tokenize_rows(
    tokenizer: PreTrainedTokenizerFast, rows: list[Row]
) -> list[tuple[list[int], list[int]]]:
    """`(input_ids, assistant_mask)` per conversation, through the chat template."""
    out = []
    for row in rows:
        enc = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


def _collate(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids` and `labels_mask` (True at t where token t+1 is trained)."""
    seq_len = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    labels_mask = torch.zeros((len(examples), seq_len), dtype=torch.bool)
    for b, (ids, mask) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        labels_mask[b, : len(ids) - 1] = torch.tensor(mask[1:], dtype=torch.bool)
    return input_ids, labels_mask


def _hidden(model: Qwen3ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    # NOTE: no attention_mask on purpose. Padding is on the right and attention is causal,
    # so real tokens never see padding; only padded positions (never trained, never
    # measured) differ. The padding mask would cost ~20% of a CPU step.
    return model.model(input_ids=input_ids).last_hidden_state


def _masked_next_token_loss(
    model: Qwen3ForCausalLM, input_ids: torch.Tensor, labels_mask: torch.Tensor
) -> torch.Tensor:
    hidden_BSH = _hidden(model, input_ids)
    # NOTE: the lm_head only on trained positions (~60% of tokens) saves a sixth of the step.
    logits_NV = model.lm_head(hidden_BSH[labels_mask])
    labels_N = input_ids[:, 1:][labels_mask[:, :-1]]
    return torch.nn.functional.cross_entropy(logits_NV, labels_N)


def _lr_at(step: int, cfg: DemoTargetConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def assistant_entropy(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: list[Row]
) -> dict[str, float]:
    """How branchy the target is on assistant tokens: mean next-token entropy (nats), the
    share of positions above 0.5 nats (branch points), and the mean loss there."""
    model.eval()
    entropies, losses = [], []
    examples = tokenize_rows(tokenizer, rows)
    for i in range(0, len(examples), 32):
        input_ids, labels_mask = _collate(examples[i : i + 32], tokenizer.pad_token_id)
        hidden = _hidden(model, input_ids)
        logp_NV = torch.log_softmax(model.lm_head(hidden[labels_mask]).float(), dim=-1)
        entropies.append(-(logp_NV.exp() * logp_NV).sum(-1))
        labels_N = input_ids[:, 1:][labels_mask[:, :-1]]
        losses.append(-logp_NV.gather(1, labels_N[:, None])[:, 0])
    entropy_N, loss_N = torch.cat(entropies), torch.cat(losses)
    return {
        "assistant_entropy_nats": entropy_N.mean().item(),
        "branch_point_fraction": (entropy_N > 0.5).float().mean().item(),
        "assistant_loss": loss_N.mean().item(),
        "num_tokens": float(entropy_N.numel()),
    }


def train_target(
    cfg: DemoTargetConfig,
    rows: list[Row],
    tokenizer: PreTrainedTokenizerFast,
    progress: bool = True,
) -> tuple[Qwen3ForCausalLM, dict[str, Any]]:
    """Train a fresh tiny Qwen3 on `rows` (loss on assistant tokens only)."""
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(build_model_config(cfg, tokenizer))
    model.train()
    examples = tokenize_rows(tokenizer, rows)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(examples), generator=generator).tolist()
    cursor, losses = 0, []
    start, start_cpu = time.perf_counter(), time.process_time()
    bar = tqdm(range(cfg.max_steps), desc="train demo target", disable=not progress, unit="step")
    for step in bar:
        batch = []
        while len(batch) < cfg.batch_size:
            if cursor == len(order):
                order = torch.randperm(len(examples), generator=generator).tolist()
                cursor = 0
            batch.append(examples[order[cursor]])
            cursor += 1
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = _masked_next_token_loss(model, *_collate(batch, tokenizer.pad_token_id))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    tail = losses[-max(1, cfg.max_steps // 10) :]
    report = {
        "config": asdict(cfg),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": time.perf_counter() - start,
        # CPU seconds of this process: with the machine shared, wall time overstates cost.
        "train_cpu_seconds": time.process_time() - start_cpu,
        "initial_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "loss_curve": losses,
    }
    return model, report


def ensure_demo_target(
    cfg: DemoTargetConfig, force: bool = False, progress: bool = True
) -> DemoTarget:
    """Return the cached demo target for `cfg`, training (and caching) it when missing."""
    rows, _ = make_corpus(cfg.seed, cfg.num_train_rows, 0)
    out_dir = cache_root(cfg) / "targets" / f"qwen3-tiny-{_cache_key(cfg, rows)}"
    report_path = out_dir / REPORT_FILE
    if report_path.is_file() and not force:
        return DemoTarget(out_dir, True, json.loads(report_path.read_text()))

    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads or min(4, os.cpu_count() or 1))
    try:
        tokenizer = train_tokenizer(rows, cfg.vocab_size)
        model, report = train_target(cfg, rows, tokenizer, progress=progress)
        if cfg.num_probe_rows > 0:  # fresh draws from the same distribution
            probe_rows, _ = make_corpus(cfg.seed + 1, cfg.num_probe_rows, 0)
            report["probe"] = assistant_entropy(model, tokenizer, probe_rows)
    finally:
        torch.set_num_threads(threads_before)

    # NOTE: write next to the final directory and rename, so an interrupted run never
    # leaves a half-written target that a later run would take for a cached one.
    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    report["size_mb"] = sum(f.stat().st_size for f in tmp_dir.iterdir()) / 2**20
    (tmp_dir / REPORT_FILE).write_text(json.dumps(report, indent=1))
    if out_dir.exists():  # force=True: move the old one aside first (rename is atomic)
        stale = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, stale)
        shutil.rmtree(stale)
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:
        # Another process finished the same target in the meantime: keep theirs.
        if not report_path.is_file():
            raise
        shutil.rmtree(tmp_dir)
    return DemoTarget(out_dir, False, report)
