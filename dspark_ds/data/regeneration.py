"""``dspark-ds regenerate``: the target writes every assistant answer itself.

Paper settings by default: T 0.7, top-p 0.8, top-k 20, non-thinking chat template. Multi-turn
rows are answered turn by turn (each answer is part of the next turn's prompt). Two paths write
the same files (``regen_parts``: part files, their input records, the merge):

- in the ranks (this module): every rank loads the target and answers its rows (row ``i`` →
  rank ``i % world``) with Hugging Face ``generate`` in batches, appending them to its part
  (flushed + fsynced per batch); when every rank is done, the parts are merged.
- through OpenAI-compatible servers (``server.urls``, ``regen_servers``): one process sends
  the turns to a fleet of SGLang / vLLM servers; no target weights are loaded.

A rerun skips the rows already written and refuses rows made from other inputs or settings
unless ``restart`` is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_ds import distributed as dist
from dspark_ds.data import regen_parts as parts
from dspark_ds.data.chat import ChatTokenizer, load_tokenizer
from dspark_ds.data.config import RegenerateConfig
from dspark_ds.data.formats import ReadStats, read_conversations
from dspark_ds.data.tokens import atomic_write_text
from dspark_ds.target import config_sha256, load_causal_lm
from dspark_ds.target_checkpoint import read_target_config


def run_inputs(cfg: RegenerateConfig) -> dict:
    """What every output row depends on: the input files' bytes and every setting that changes
    an answer, with a sha256 over all of it (``fingerprint``)."""
    target_config = read_target_config(
        cfg.target.path,
        revision=cfg.target.revision,
        trust_remote_code=cfg.target.trust_remote_code,
    )
    settings = parts.answer_settings(cfg) | {
        "target.path": cfg.target.path,
        "target.revision": cfg.target.revision,
        "target.dtype": cfg.target.dtype,
        "target config": config_sha256(target_config),
        "data.tokenizer": cfg.data.tokenizer or cfg.target.path,
        # the batch decides the padding and each batch's sampling seed
        "batch_size": cfg.batch_size,
    }
    return parts.inputs_record(settings)


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
            min_p=self.cfg.min_p if sample and self.cfg.min_p > 0 else None,
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
        system, users = parts.split_prompt(row.messages)
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


def _open_part(cfg: RegenerateConfig, rank: int, world: int) -> tuple[Path, set[int]]:
    """This rank's part file (`open_part`) and the ids it already holds."""
    part = parts.open_part(cfg, rank, world, run_inputs(cfg))
    part.with_suffix(".done").unlink(missing_ok=True)  # a stale one would start the merge early
    return part, {rec["id"] for rec in parts.read_part(part)}


def _load_generator(cfg: RegenerateConfig) -> _Generator:
    device = torch.device(cfg.target.device) if cfg.target.device else dist.local_device()
    model = load_causal_lm(cfg.target).to(device).eval()
    tok = load_tokenizer(cfg.data.tokenizer or cfg.target.path, cfg.target.trust_remote_code)
    return _Generator(cfg, parts.prompt_chat(cfg, tok), model, device)


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
        system, users = parts.split_prompt(row.messages)
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
    done_files = [parts.part_path(cfg.output, r, world).with_suffix(".done") for r in range(world)]
    all_done = all(f.exists() for f in done_files)
    if not (rank == 0 if dist.has_group() else all_done):
        return None
    total = parts.merge_parts(cfg.output, world)
    total["skipped"] = sum(json.loads(f.read_text())["skipped"] for f in done_files)
    dist.log(
        f"[regenerate] {cfg.output}: written {total['written']}, failed "
        f"{total['failed']}, skipped {total['skipped']}"
    )
    return total


def regenerate(cfg: RegenerateConfig) -> dict:
    """Regenerate this rank's share of ``cfg.data.paths``; the last rank done merges. With
    ``cfg.server.urls``: one process answers every row through the servers."""
    if cfg.server.urls:
        # lazy: aiohttp, 0.1 s of `regenerate --help` (docs/testing.md)
        from dspark_ds.data.regen_servers import regenerate_with_servers

        return regenerate_with_servers(cfg)
    parts.check_paths(cfg, need_target=True)
    dist.init("gloo", always=False, settings=cfg.distributed)
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
