"""``dspark-ds regenerate``: the target writes every assistant answer itself.

Paper settings by default: T 0.7, top-p 0.8, top-k 20, non-thinking chat template. Rows are
split across ranks (row ``i`` → rank ``i % world``). Each rank appends finished rows to its
part file ``<output>.parts/part-<rank>-of-<world>.jsonl`` (flushed + fsynced per batch), so a
rerun after a crash skips what is there. When every rank is done, the parts are merged —
sorted by row id, each exactly once — into ``<output>`` (atomic rename); failures go to
``<output>.failed.jsonl``. Multi-turn rows are answered turn by turn (each answer is part of
the next turn's prompt).

Next to each part, ``part-R-of-W.inputs.json`` records what its rows were made from: the
sha256 of every input file and every setting that changes an answer. A rerun resumes only
rows with the same record; otherwise it refuses, naming what changed, unless ``restart`` is
set (then the earlier rows and output are discarded).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_ds import distributed as dist
from dspark_ds.data.chat import ChatTokenizer, load_tokenizer
from dspark_ds.data.config import RegenerateConfig
from dspark_ds.data.formats import ReadStats, read_conversations
from dspark_ds.data.tokens import atomic_write_text
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_exists, check_model_path, first_line, sha256_file


def _parts_dir(output: str) -> Path:
    return Path(f"{output}.parts")


def _part_path(output: str, rank: int, world: int) -> Path:
    return _parts_dir(output) / f"part-{rank:05d}-of-{world:05d}.jsonl"


def _inputs_path(part: Path) -> Path:
    return part.with_suffix(".inputs.json")


def run_inputs(cfg: RegenerateConfig) -> dict:
    """What every output row depends on: the input files' bytes and every setting that changes
    an answer, with a sha256 over all of it (``fingerprint``)."""
    from transformers import AutoConfig

    from dspark_ds.target import config_sha256

    try:
        target_config = AutoConfig.from_pretrained(
            cfg.target.path,
            revision=cfg.target.revision,
            trust_remote_code=cfg.target.trust_remote_code,
        )
    except OSError as err:
        raise ConfigError(
            f"target.path: cannot read a model config from {cfg.target.path!r} ({first_line(err)})"
        ) from None
    settings: dict = {
        "data.paths": [str(p) for p in cfg.data.paths],  # rows record their `source` file
        **{f"data.paths[{i}] content": sha256_file(p) for i, p in enumerate(cfg.data.paths)},
        "target.path": cfg.target.path,
        "target.revision": cfg.target.revision,
        "target.dtype": cfg.target.dtype,
        "target config": config_sha256(target_config),
        "data.tokenizer": cfg.data.tokenizer or cfg.target.path,
        "data.max_length": cfg.data.max_length,
        "data.enable_thinking": cfg.data.enable_thinking,
        "data.system_prompt": cfg.data.system_prompt,
        # the batch decides the padding and each batch's sampling seed
        "batch_size": cfg.batch_size,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
    }
    if cfg.temperature > 0:  # greedy answers ignore the sampling settings
        settings.update(top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
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
    parts = _parts_dir(output)
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
            if part.stat().st_size and not _inputs_path(part).exists():
                return f"{part} holds rows with no record of the inputs they were made from"
    if Path(output).exists() and not records:
        return f"{output} exists with no record of the inputs it was made from"
    return None


def _discard_earlier_rows(output: str, rank: int, world: int) -> None:
    """``restart``: this rank removes its own part files; rank 0 also the merged output and
    the parts of other world sizes (every rank touches only files no other rank touches)."""
    own = _part_path(output, rank, world)
    doomed = [own, _inputs_path(own), own.with_suffix(".done")]
    if rank == 0:
        doomed += [Path(output), Path(f"{output}.failed.jsonl")]
        if _parts_dir(output).is_dir():
            doomed += [p for p in _parts_dir(output).iterdir() if f"-of-{world:05d}." not in p.name]
    for path in doomed:
        path.unlink(missing_ok=True)


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


def _prompt(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """(system messages, user turns) of a conversation; its answers are dropped."""
    system = [m for m in messages if m["role"] == "system"]
    return system, [m["content"] for m in messages if m["role"] == "user"]


class _Generator:
    def __init__(self, cfg: RegenerateConfig, chat: ChatTokenizer, model, device):
        self.cfg, self.chat, self.model, self.device = cfg, chat, model, device
        tok = chat.tok
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.eos_ids = tok.eos_token_id

    @torch.no_grad()
    def answer(self, histories: list[list[dict]], seed: int) -> list[tuple[str, bool]]:
        """One answer per history (left-padded batch) → (text, hit_eos)."""
        prompts = [self.chat.prompt_ids(h) for h in histories]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # NOTE: left padding, so every row ends at the prompt
            ids[b, width - len(p) :] = torch.tensor(p)
            attn[b, width - len(p) :] = 1
        torch.manual_seed(seed)
        sample = self.cfg.temperature > 0
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            max_new_tokens=self.cfg.max_new_tokens,
            do_sample=sample,
            temperature=self.cfg.temperature if sample else None,
            top_p=self.cfg.top_p if sample else None,
            top_k=self.cfg.top_k if sample else None,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
        )
        answers = []
        for row in out[:, width:].tolist():
            hit_eos = self.eos_ids in row
            row = row[: row.index(self.eos_ids)] if hit_eos else row
            text = self.chat.tok.decode(row, skip_special_tokens=True).strip()
            answers.append((text, hit_eos))
        return answers


def _regenerate_batch(gen: _Generator, rows, cfg: RegenerateConfig) -> list[dict]:
    """Answer every user turn of ``rows``; one output record per row (ok or failed)."""
    convs = []
    for row in rows:
        system, users = _prompt(row.messages)
        convs.append(
            {
                "id": row.index,
                "source": row.source,
                "messages": list(system),
                "users": users,
                "truncated": 0,
            }
        )
    for turn in range(max(len(c["users"]) for c in convs)):
        active = [c for c in convs if turn < len(c["users"]) and "error" not in c]
        if not active:
            continue
        for c in active:
            c["messages"].append({"role": "user", "content": c["users"][turn]})
        try:
            answers = gen.answer(
                [c["messages"] for c in active], cfg.seed * 1_000_003 + active[0]["id"] * 101 + turn
            )
        except (RuntimeError, ValueError) as e:  # e.g. OOM on an outlier: retry one by one
            if len(active) == 1:
                active[0]["error"] = f"generation failed: {e}"[:500]
                continue
            answers = []
            for c in active:
                try:
                    answers += gen.answer(
                        [c["messages"]], cfg.seed * 1_000_003 + c["id"] * 101 + turn
                    )
                except (RuntimeError, ValueError) as e2:
                    answers.append((None, str(e2)[:500]))
        for c, (text, hit_eos) in zip(active, answers):
            if text is None:
                c["error"] = f"generation failed: {hit_eos}"
            elif not text:
                c["error"] = f"empty answer at turn {turn}"
            else:
                c["messages"].append({"role": "assistant", "content": text})
                c["truncated"] += not hit_eos
    out = []
    for c in convs:
        rec = {"id": c["id"], "source": c["source"]}
        if "error" in c:
            rec["error"] = c["error"]
        else:
            rec["messages"] = c["messages"]
            if c["truncated"]:
                rec["truncated_turns"] = c["truncated"]
        out.append(rec)
    return out


def merge_parts(output: str, world: int) -> dict:
    """Merge every rank's part into ``output`` (sorted, each id once); return the counts."""
    records = {}
    for r in range(world):
        for rec in read_part(_part_path(output, r, world)):
            if rec["id"] in records:
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


def _check_paths(cfg: RegenerateConfig) -> None:
    if not cfg.output:
        raise ConfigError("output is required (the jsonl to write)")
    if not cfg.target.path:
        raise ConfigError("target.path is required")
    for i, path in enumerate(cfg.data.paths):
        check_exists(path, f"data.paths[{i}]")
    check_model_path(cfg.target.path, "target.path")
    check_model_path(cfg.data.tokenizer, "data.tokenizer")


def _open_part(cfg: RegenerateConfig, rank: int, world: int) -> tuple[Path, set[int]]:
    """This rank's part file, ready to append to, and the ids it already holds. Rows an earlier
    run wrote with other inputs are refused by every rank together (or discarded on restart)."""
    part = _part_path(cfg.output, rank, world)
    inputs = run_inputs(cfg)
    problem = None if cfg.restart else earlier_rows_problem(cfg.output, inputs)
    problems = [p for p in dist.all_gather_object(problem) if p]
    if problems:  # every rank refuses together
        raise ConfigError(
            f"regenerate: {problems[0]}; rerun with --restart true to discard them and start "
            "over, or write to another --output"
        )
    if cfg.restart:
        _discard_earlier_rows(cfg.output, rank, world)
        dist.barrier()
    part.parent.mkdir(parents=True, exist_ok=True)
    part.with_suffix(".done").unlink(missing_ok=True)  # a stale one would start the merge early
    atomic_write_text(_inputs_path(part), json.dumps(inputs, indent=1, sort_keys=True))
    return part, {rec["id"] for rec in read_part(part)}


def _load_generator(cfg: RegenerateConfig) -> _Generator:
    from transformers import AutoModelForCausalLM

    device = torch.device(cfg.target.device) if cfg.target.device else dist.local_device()
    model = (
        AutoModelForCausalLM.from_pretrained(
            cfg.target.path,
            dtype=cfg.target.torch_dtype,
            revision=cfg.target.revision,
            trust_remote_code=cfg.target.trust_remote_code,
        )
        .to(device)
        .eval()
    )
    tok = load_tokenizer(cfg.data.tokenizer or cfg.target.path, cfg.target.trust_remote_code)
    # Only prompts are rendered here (no loss mask), with the data's own system prompt.
    chat = ChatTokenizer(
        tok, cfg.data.max_length, cfg.data.enable_thinking, cfg.data.system_prompt,
        chat_format="answer_only",
    )  # fmt: skip
    return _Generator(cfg, chat, model, device)


def _rows_to_answer(
    cfg: RegenerateConfig, chat: ChatTokenizer, rank: int, world: int, done: set[int]
) -> tuple[list, dict[str, int]]:
    """This rank's rows still to answer, and the counts of those it leaves out."""
    stats = ReadStats()
    counts = {"written": 0, "failed": 0, "skipped": 0, "already_done": 0}
    mine = []
    for row in read_conversations(cfg.data.paths, cfg.data.skip_bad_rows, stats):
        if row.index % world != rank:
            continue
        system, users = _prompt(row.messages)
        if row.index in done:
            counts["already_done"] += 1
        elif len(chat.prompt_ids(system + [{"role": "user", "content": users[0]}])) >= (
            cfg.data.max_length
        ):
            counts["skipped"] += 1  # the prompt alone exceeds max_length
        else:
            mine.append(row)
    counts["skipped"] += stats.bad if rank == 0 else 0
    return mine, counts


def _answer_into(part: Path, gen: _Generator, mine: list, cfg, rank: int, counts: dict) -> None:
    """Appends a record per row to the part, batch by batch, each batch synced to disk."""
    with (
        open(part, "a", encoding="utf-8") as f,
        tqdm(total=len(mine), desc=f"regenerate rank {rank}", unit="row", disable=rank != 0) as bar,
    ):
        for k in range(0, len(mine), cfg.batch_size):
            for rec in _regenerate_batch(gen, mine[k : k + cfg.batch_size], cfg):
                counts["failed" if "error" in rec else "written"] += 1
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(min(cfg.batch_size, len(mine) - k))
            bar.set_postfix(written=counts["written"], failed=counts["failed"])


def _merge_when_all_done(cfg: RegenerateConfig, rank: int, world: int) -> dict | None:
    """Rank 0 (or, without a process group, whichever rank finds every part done) merges."""
    done_files = [_part_path(cfg.output, r, world).with_suffix(".done") for r in range(world)]
    all_done = all(f.exists() for f in done_files)
    if not (rank == 0 if dist.has_group() else all_done):
        return None
    total = merge_parts(cfg.output, world)
    total["skipped"] = sum(json.loads(f.read_text())["skipped"] for f in done_files)
    dist.log(
        f"[regenerate] {cfg.output}: written {total['written']}, failed "
        f"{total['failed']}, skipped {total['skipped']}"
    )
    return total


def regenerate(cfg: RegenerateConfig) -> dict:
    """Regenerate this rank's share of ``cfg.data.paths``; the last rank done merges."""
    _check_paths(cfg)
    dist.init("gloo", always=False, timeout_s=1800)
    rank, world = dist.rank_and_world()
    part, done = _open_part(cfg, rank, world)
    gen = _load_generator(cfg)
    mine, counts = _rows_to_answer(cfg, gen.chat, rank, world, done)
    _answer_into(part, gen, mine, cfg, rank, counts)
    dist.log(
        f"[regenerate] rank {rank}/{world}: written {counts['written']}, failed "
        f"{counts['failed']}, skipped {counts['skipped']}, already done "
        f"{counts['already_done']}"
    )
    atomic_write_text(part.with_suffix(".done"), json.dumps(counts))
    dist.barrier()
    total = _merge_when_all_done(cfg, rank, world)
    dist.barrier()
    return total if total is not None else counts
