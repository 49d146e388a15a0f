"""``dspark-ds regenerate`` through OpenAI-compatible servers (``server.urls``): one process
answers every row, turn by turn, through a ``Fleet``; no target weights are loaded.

Each turn is one ``/v1/chat/completions`` request with the row's messages so far (the data's
system prompt added as the in-rank path adds it), ``max_tokens`` = ``max_new_tokens``,
``temperature``, and when sampling ``top_p``, ``top_k``, ``min_p`` (fields SGLang and vLLM take
beside OpenAI's) and a ``seed`` per row and turn; ``chat_template_kwargs`` carries
``enable_thinking`` (``data.enable_thinking``, off by default). ``server.concurrency`` rows are
in flight at once. The tokenizer (``data.tokenizer``, else ``target.path``, else the served
model's name) only decides which prompts exceed ``data.max_length`` (skipped, as in the ranks).

Files: the in-rank path's layout (``regen_parts``) with one writer, ``part-00000-of-00001``.
Each row is appended and flushed as its last turn is answered, so Ctrl-C or a killed client
keeps every finished row; the file is fsynced at most every second and at the end (a lost
machine loses at most the last second of rows, which a rerun answers again). A row whose
request failed every retry is recorded with the reason; a rerun tries it again, and the merge
keeps the answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from tqdm import tqdm

from dspark_ds import distributed as dist
from dspark_ds import logs
from dspark_ds.data import regen_parts as parts
from dspark_ds.data.chat import ChatTokenizer, load_tokenizer
from dspark_ds.data.config import RegenerateConfig
from dspark_ds.data.fleet import Fleet, FleetDown, RequestFailed
from dspark_ds.data.formats import ReadStats, read_conversations
from dspark_ds.errors import ConfigError, TrainingStopped
from dspark_ds.files import first_line

FSYNC_INTERVAL_S = 1.0


def request_fields(cfg: RegenerateConfig) -> dict:
    """The fields every chat request of the run carries (besides the model and the messages)."""
    fields = {
        "max_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "chat_template_kwargs": {"enable_thinking": cfg.data.enable_thinking},
    }
    if cfg.temperature > 0:  # NOTE: top_k -1 is "off" for both SGLang and vLLM
        fields.update(top_p=cfg.top_p, top_k=cfg.top_k or -1, min_p=cfg.min_p)
    return fields


def _say(message: str) -> None:
    """A status line that leaves the progress bar intact."""
    tqdm.write(logs.format_lines(message, 0).rstrip("\n"))


class _PartWriter:
    """Appends records to the part: each flushed at once, fsynced at most every second."""

    def __init__(self, path: Path):
        self.f = open(path, "a", encoding="utf-8")
        self.synced_at = time.monotonic()

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        if time.monotonic() - self.synced_at >= FSYNC_INTERVAL_S:
            os.fsync(self.f.fileno())
            self.synced_at = time.monotonic()

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


class _ServerRun:
    """One client run: start-up checks, the rows, the answers, the summary."""

    def __init__(self, cfg: RegenerateConfig):
        self.cfg = cfg
        self.part = parts.part_path(cfg.output, 0, 1)
        self.counts = {"written": 0, "failed": 0, "skipped": 0, "already_done": 0}
        self.truncated_turns = 0
        self.fleet: Fleet | None = None
        self.t0: float | None = None  # when the answering started
        self.seconds = 0.0

    # ---- set-up -------------------------------------------------------------------------
    def _chat(self, model: str) -> tuple[ChatTokenizer, str]:
        cfg = self.cfg
        name = cfg.data.tokenizer or cfg.target.path or model
        try:
            tok = load_tokenizer(name, cfg.target.trust_remote_code)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"data.tokenizer: cannot load {name!r} ({first_line(err)}); the server path "
                "reads the target's tokenizer to apply data.max_length: set data.tokenizer"
            ) from None
        return parts.prompt_chat(cfg, tok), name

    def _open_part(self, model: str, tokenizer: str) -> set[int]:
        """Refuses rows of other inputs (or discards them on restart); the ids already answered."""
        cfg = self.cfg
        inputs = parts.inputs_record(
            parts.answer_settings(cfg) | {"server.model": model, "data.tokenizer": tokenizer}
        )
        parts.open_part(cfg, 0, 1, inputs)
        return {rec["id"] for rec in parts.read_part(self.part) if "error" not in rec}

    def _rows(self, done: set[int]) -> list:
        stats = ReadStats()
        rows = []
        for row in read_conversations(self.cfg.data.paths, self.cfg.data.skip_bad_rows, stats):
            if row.index in done:
                self.counts["already_done"] += 1
            else:
                rows.append(row)
        self.counts["skipped"] += stats.bad
        return rows

    # ---- answering ----------------------------------------------------------------------
    async def _answer_row(self, row, chat: ChatTokenizer, fields: dict) -> dict | None:
        """The row's record (answered, or failed with the reason); None: skipped."""
        cfg = self.cfg
        system, users = parts.split_prompt(row.messages)
        first = system + [{"role": "user", "content": users[0]}]
        if len(chat.prompt_ids(first)) >= cfg.data.max_length:
            return None  # the prompt alone exceeds max_length
        messages = list(system)
        truncated = 0
        for turn, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            body = {**fields, "messages": chat.with_system(messages)}
            if cfg.temperature > 0:
                body["seed"] = cfg.seed * 1_000_003 + row.index * 101 + turn
            try:
                answer = await self.fleet.chat(body)
            except RequestFailed as err:
                return {"id": row.index, "source": row.source, "error": f"turn {turn}: {err}"}
            text = answer.text.strip()
            if not text:
                return {
                    "id": row.index,
                    "source": row.source,
                    "error": f"empty answer at turn {turn}",
                }
            messages.append({"role": "assistant", "content": text})
            truncated += answer.finish_reason == "length"
        rec = {"id": row.index, "source": row.source, "messages": messages}
        if truncated:
            rec["truncated_turns"] = truncated
            self.truncated_turns += truncated
        return rec

    def _postfix(self) -> str:
        servers = self.fleet.servers
        tokens = sum(s.tokens for s in servers)
        answered = max(1, sum(s.answered for s in servers))
        shares = [100 * s.answered / answered for s in servers]
        if len(servers) <= 8:
            share = "/".join(f"{p:.0f}" for p in shares)
        else:
            share = f"{min(shares):.1f}-{max(shares):.1f}"
        down = sum(not s.up for s in servers)
        return (
            f"{tokens / max(time.monotonic() - self.t0, 1e-9):.0f} tok/s, failed "
            f"{self.counts['failed']}, length {self.truncated_turns}, share % {share}"
            + (f", {down} down" if down else "")
        )

    async def _answer_all(self, rows: list, chat: ChatTokenizer, writer: _PartWriter) -> None:
        fields = request_fields(self.cfg)
        todo = iter(rows)
        bar = tqdm(total=len(rows), desc="regenerate", unit="row", dynamic_ncols=True)

        async def worker() -> None:
            for row in todo:  # NOTE: one thread: the workers share the iterator safely
                rec = await self._answer_row(row, chat, fields)
                if rec is None:
                    self.counts["skipped"] += 1
                else:
                    writer.write(rec)
                    self.counts["failed" if "error" in rec else "written"] += 1
                bar.set_postfix_str(self._postfix(), refresh=False)
                bar.update()

        tasks = [
            asyncio.create_task(worker())
            for _ in range(min(self.cfg.server.concurrency, len(rows)))
        ]
        try:
            if tasks:
                finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for task in finished:
                    task.result()  # the first failure (FleetDown), if any
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()

    async def main(self) -> None:
        cfg = self.cfg
        fields = request_fields(cfg)
        async with Fleet(cfg.server, say=_say) as fleet:
            self.fleet = fleet
            model = await fleet.check(fields)
            chat, tokenizer = self._chat(model)
            rows = self._rows(self._open_part(model, tokenizer))
            dist.log(
                f"[regenerate] {len(rows)} rows to answer ({self.counts['already_done']} already "
                f"done) through {len(fleet.servers)} server(s), model {model!r}, concurrency "
                f"{cfg.server.concurrency}"
            )
            writer = _PartWriter(self.part)
            self.t0 = time.monotonic()
            try:
                await self._answer_all(rows, chat, writer)
            finally:
                writer.close()
                self.seconds = time.monotonic() - self.t0

    # ---- reporting ----------------------------------------------------------------------
    def summary(self) -> dict:
        servers = self.fleet.servers
        rows = self.counts["written"] + self.counts["failed"]
        tokens = sum(s.tokens for s in servers)
        seconds = max(self.seconds, 1e-9)
        answered = max(1, sum(s.answered for s in servers))
        lines = [
            f"[regenerate] {rows} rows in {self.seconds:.1f} s through {len(servers)} server(s): "
            f"{rows / seconds:.2f} rows/s, {tokens / seconds:.1f} generated tokens/s ({tokens} "
            f"tokens); answered {self.counts['written']}, failed {self.counts['failed']}, "
            f"skipped {self.counts['skipped']}, already done {self.counts['already_done']}; "
            f"{self.truncated_turns} answers cut at max_new_tokens (finish_reason length)"
        ]
        lines += [
            f"[regenerate]   {s.base}: {100 * s.answered / answered:.1f} % of the answers "
            f"({s.answered} answers, {s.tokens} tokens), {s.errors} failed requests, out of "
            f"rotation {s.outages} times"
            for s in servers
        ]
        dist.log("\n".join(lines))
        return {
            "rows_per_s": rows / seconds,
            "tokens_per_s": tokens / seconds,
            "truncated_turns": self.truncated_turns,
            "servers": [
                {
                    "url": s.base,
                    "answered": s.answered,
                    "tokens": s.tokens,
                    "errors": s.errors,
                    "outages": s.outages,
                }
                for s in servers
            ],
        }


def _check_inputs(cfg: RegenerateConfig) -> None:
    parts.check_paths(cfg, need_target=False)
    _, world = dist.rank_and_world()
    if world > 1:
        raise ConfigError(
            f"server.urls: one client process drives every server, and this is one of {world} "
            "ranks; start it as a single process (slurm/regenerate.sbatch does)"
        )


def regenerate_with_servers(cfg: RegenerateConfig) -> dict:
    """Answer every row of ``cfg.data.paths`` through the servers of ``cfg.server``; merge."""
    _check_inputs(cfg)
    run = _ServerRun(cfg)
    try:
        asyncio.run(run.main())
    except KeyboardInterrupt:
        if run.t0 is not None:
            dist.log(
                f"[regenerate] interrupted: {run.counts['written'] + run.counts['failed']} rows "
                f"of this run are kept in {run.part}; the same command resumes"
            )
        raise
    except FleetDown as err:
        raise TrainingStopped(
            f"regenerate: {err}; {run.counts['written']} rows of this run are kept in "
            f"{run.part}, the same command resumes"
        ) from None
    extra = run.summary()
    total = parts.merge_parts(cfg.output, 1)
    total["skipped"] = run.counts["skipped"]
    total["already_done"] = run.counts["already_done"]
    dist.log(
        f"[regenerate] {cfg.output}: written {total['written']}, failed {total['failed']} "
        f"({cfg.output}.failed.jsonl), skipped {total['skipped']}"
    )
    return total | extra
