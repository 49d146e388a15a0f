"""What both regeneration paths (the target in the ranks, inference servers) share: what they
write on disk, the checks of their paths (`check_paths`) and their prompt renderer
(`prompt_chat`).

Each writing process appends finished rows to its part file
``<output>.parts/part-<rank>-of-<world>.jsonl`` and records, next to it in
``part-R-of-W.inputs.json``, what its rows were made from: the sha256 of every input file and
every setting that changes an answer. A rerun resumes only rows with the same record; otherwise
it refuses, naming what changed, unless ``restart`` is set (then the earlier rows and output
are discarded). The merge writes every row once, sorted by id, into ``<output>`` (atomic
rename) and the failures into ``<output>.failed.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dspark_ds import distributed as dist
from dspark_ds.data.chat import ChatTokenizer
from dspark_ds.data.config import RegenerateConfig
from dspark_ds.data.tokens import atomic_write_text
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_exists, check_model_path, sha256_file


def parts_dir(output: str) -> Path:
    return Path(f"{output}.parts")


def part_path(output: str, rank: int, world: int) -> Path:
    return parts_dir(output) / f"part-{rank:05d}-of-{world:05d}.jsonl"


def inputs_path(part: Path) -> Path:
    return part.with_suffix(".inputs.json")


def answer_settings(cfg: RegenerateConfig) -> dict:
    """What both paths' answers depend on: the input files (by content), the prompt and the
    sampling settings."""
    settings: dict = {
        "data.paths": [str(p) for p in cfg.data.paths],  # rows record their `source` file
        **{f"data.paths[{i}] content": sha256_file(p) for i, p in enumerate(cfg.data.paths)},
        "data.max_length": cfg.data.max_length,
        "data.enable_thinking": cfg.data.enable_thinking,
        "data.system_prompt": cfg.data.system_prompt,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
    }
    if cfg.temperature > 0:  # greedy answers ignore the sampling settings
        settings.update(top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
        if cfg.min_p > 0:  # NOTE: only when set, so rows made before min_p existed resume
            settings.update(min_p=cfg.min_p)
    return settings


def inputs_record(settings: dict) -> dict:
    """``settings`` with a sha256 over all of them (``fingerprint``)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return {"fingerprint": digest, "settings": settings}


def _what_changed(old: dict, new: dict) -> str:
    changed = []
    for key in sorted(set(old) | set(new), key=lambda k: (k.startswith("data.paths["), k)):
        a, b = old.get(key, "unset"), new.get(key, "unset")
        if a != b:
            hashed = key.endswith(("content", "config"))
            changed.append(f"{key} changed" if hashed else f"{key} {a!r} -> {b!r}")
    return ", ".join(changed[:4]) + (f" (+{len(changed) - 4} more)" if len(changed) > 4 else "")


def earlier_rows_problem(output: str, inputs: dict) -> str | None:
    """Why the rows an earlier run left for ``output`` cannot be resumed with ``inputs`` (None:
    they can, or there are none)."""
    parts = parts_dir(output)
    records = sorted(parts.glob("part-*.inputs.json")) if parts.is_dir() else []
    for record in records:
        try:
            old = json.loads(record.read_text())["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{record} is unreadable, so the rows beside it cannot be trusted"
        if old != inputs["settings"]:
            return (
                f"{parts} holds rows made from other inputs or settings "
                f"({_what_changed(old, inputs['settings'])})"
            )
    if parts.is_dir():
        for part in sorted(parts.glob("part-*.jsonl")):
            if part.stat().st_size and not inputs_path(part).exists():
                return f"{part} holds rows with no record of the inputs they were made from"
    if Path(output).exists() and not records:
        return f"{output} exists with no record of the inputs it was made from"
    return None


def refuse_message(problem: str) -> str:
    return (
        f"regenerate: {problem}; rerun with --restart true to discard them and start over, or "
        "write to another --output"
    )


def discard_earlier_rows(output: str, rank: int, world: int) -> None:
    """``restart``: this rank removes its own part files; rank 0 also the merged output and
    the parts of other world sizes (every rank touches only files no other rank touches)."""
    own = part_path(output, rank, world)
    doomed = [own, inputs_path(own), own.with_suffix(".done")]
    if rank == 0:
        doomed += [Path(output), Path(f"{output}.failed.jsonl")]
        if parts_dir(output).is_dir():
            doomed += [p for p in parts_dir(output).iterdir() if f"-of-{world:05d}." not in p.name]
    for path in doomed:
        path.unlink(missing_ok=True)


def check_paths(cfg: RegenerateConfig, *, need_target: bool) -> None:
    """The output is named and the input files, the target and the tokenizer exist (the servers'
    path names no target: `need_target` False)."""
    if not cfg.output:
        raise ConfigError("output is required (the jsonl to write)")
    if need_target and not cfg.target.path:
        raise ConfigError("target.path is required")
    for i, path in enumerate(cfg.data.paths):
        check_exists(path, f"data.paths[{i}]")
    check_model_path(cfg.target.path, "target.path")
    check_model_path(cfg.data.tokenizer, "data.tokenizer")


def open_part(cfg: RegenerateConfig, rank: int, world: int, inputs: dict) -> Path:
    """This rank's part file, ready to append to, with `inputs` recorded next to it. Rows an
    earlier run wrote with other inputs are refused by every rank together (or discarded on
    restart)."""
    part = part_path(cfg.output, rank, world)
    problem = None if cfg.restart else earlier_rows_problem(cfg.output, inputs)
    problems = [p for p in dist.all_gather_object(problem) if p]
    if problems:  # every rank refuses together
        raise ConfigError(refuse_message(problems[0]))
    if cfg.restart:
        discard_earlier_rows(cfg.output, rank, world)
        dist.barrier()
    part.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(inputs_path(part), json.dumps(inputs, indent=1, sort_keys=True))
    return part


def read_part(path: Path) -> list[dict]:
    """Records of a part file; a torn last line (crash mid-write) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def prompt_chat(cfg: RegenerateConfig, tokenizer) -> ChatTokenizer:
    """What renders the prompts of both paths (no loss mask: only prompts are rendered here),
    with the data's own system prompt and thinking setting."""
    return ChatTokenizer(
        tokenizer,
        cfg.data.max_length,
        cfg.data.enable_thinking,
        cfg.data.system_prompt,
        chat_format="answer_only",
    )


def split_prompt(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """(system messages, user turns) of a conversation; its answers are dropped."""
    system = [m for m in messages if m["role"] == "system"]
    return system, [m["content"] for m in messages if m["role"] == "user"]


def merge_parts(output: str, world: int) -> dict:
    """Merge every rank's part into ``output`` (sorted, each id once) and the failures into
    ``<output>.failed.jsonl``; return the counts. A row that failed and was answered by a later
    run counts as answered (the later record wins over a failure, never over an answer)."""
    records = {}
    for r in range(world):
        for rec in read_part(part_path(output, r, world)):
            earlier = records.get(rec["id"])
            if earlier is not None and "error" not in earlier:
                raise RuntimeError(f"sample {rec['id']} was written twice (rank parts overlap)")
            records[rec["id"]] = rec
    good = [records[i] for i in sorted(records) if "error" not in records[i]]
    bad = [records[i] for i in sorted(records) if "error" in records[i]]
    atomic_write_text(
        output,
        "".join(
            json.dumps({"id": r["id"], "source": r["source"], "messages": r["messages"]}) + "\n"
            for r in good
        ),
    )
    atomic_write_text(f"{output}.failed.jsonl", "".join(json.dumps(r) + "\n" for r in bad))
    return {"written": len(good), "failed": len(bad)}
