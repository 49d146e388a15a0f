"""Benchmark prompts: the `{"turns": [...]}` jsonl layout of the DSpark paper's evaluation sets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from dspark_ds.errors import ConfigError

# The paper's Table 1 sets shipped with the package (see datasets/README.md for provenance).
PACKAGED_DATA_DIR = Path(__file__).parent / "datasets"
DEFAULT_BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "aime25")
# Prompts per benchmark in the reference's evaluation script (a seeded subset where a file holds
# more): the sizes behind the paper's Table 1. Other benchmarks use every row.
PAPER_SAMPLES = {
    "gsm8k": 500,
    "math500": 500,
    "aime25": 30,
    "humaneval": 164,
    "mbpp": 256,
    "livecodebench": 500,
    "mt-bench": 80,
    "alpaca": 500,
    "arena-hard-v2": 500,
}
# The reference's evaluation seed (prompt subsets and sampling).
PAPER_SEED = 980406


def num_prompts(name: str, max_samples: int | None) -> int | None:
    """Prompts to decode from benchmark `name`: `max_samples`, or the paper's size when None
    (None again, = every row, for a benchmark the paper does not list)."""
    return PAPER_SAMPLES.get(name) if max_samples is None else max_samples


def benchmark_path(name: str, data_dir: str | Path | None) -> Path:
    """`<data_dir>/<name>.jsonl`, the packaged copy when `data_dir` is None."""
    root = PACKAGED_DATA_DIR if data_dir is None else Path(data_dir)
    path = root / f"{name}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in root.glob("*.jsonl")) if root.is_dir() else []
        raise ConfigError(f"benchmark {name!r}: no file {path} (found: {known})")
    return path


def load_benchmark(path: str | Path) -> list[list[str]]:
    """Each row's `turns`: a non-empty list of strings. Errors name the file and line."""
    rows: list[list[str]] = []
    with open(path, "rb") as handle:  # decoded line by line: a bad byte names its line
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    f"{path}:{line_no}: not valid UTF-8 (byte 0x{raw[err.start]:02x})"
                ) from None
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise ConfigError(f"{path}:{line_no}: `turns` must be a non-empty list of strings")
            rows.append(turns)
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows


def select_prompts(rows: list[list[str]], max_samples: int | None, seed: int) -> list[list[str]]:
    """A seeded random subset of at most `max_samples` rows (all rows, in order, when None)."""
    if max_samples is None or max_samples >= len(rows):
        return list(rows)
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in sorted(order[:max_samples])]


def shard(items: list, rank: int, world_size: int) -> list[tuple[int, object]]:
    """This rank's (global index, item) pairs: round-robin, so long and short prompts mix."""
    return [(i, items[i]) for i in range(rank, len(items), world_size)]


def encode_prompt(tokenizer, turns: list[str], chat_template_kwargs: dict | None) -> torch.Tensor:
    """The first user turn, chat-templated with a generation prompt, as ids [1, L].

    NOTE: only the first turn is used (as DeepSpec does): later MT-Bench turns refer to an answer
    the target would have to generate first, which would make τ depend on two decodes.
    """
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": turns[0]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **(chat_template_kwargs or {}),
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)
