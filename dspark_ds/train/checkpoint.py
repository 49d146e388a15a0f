"""The run's checkpoints: one manager over every part of the run a checkpoint holds.

    the engine      the drafter's trainable weights, the optimizer, the learning-rate scheduler
                    (DeepSpeed's own files, `engine/checkpoint.py`)
    the data        the batch source's position (its `state_dict` / `load_state_dict`)
    the RNG         Python's, NumPy's, torch's and CUDA's generators (`train/rng.py`)
    the run         step, epoch, schedule, non-finite counters (the trainer's `state_dict` /
                    `load_state_dict`)

What the trainer asks of it:

    checkpoints.find_resume(run_config, draft_config, ds_config)
        collective, before the run is built: the checkpoint to continue (`Resume`) or None.
        The newest complete tag that passes verification (a damaged one is named and the next
        older one tried; newer tags are set aside); a resume that would change what the
        checkpoint means is refused (`train/resume.py`'s rules, exit 2); on another world size
        DeepSpeed's universal checkpoint, converted once, and a DeepSpeed config that loads it.
    checkpoints.attach(engine, data=..., run=..., files=...)   the parts, once they are built
    checkpoints.load()           collective: every part as the resumed checkpoint left it
    checkpoints.should_save(step, last_step=...)   the cadence (checkpoint.every_steps, save_final)
    checkpoints.save(step)       collective: every rank hashes its own files, rank 0 writes
                                 MANIFEST.json, then COMPLETE and `latest`, and prunes older tags
                                 beyond checkpoint.keep_last; or TrainingStopped on every rank
                                 with the previous checkpoint intact

The on-disk layout is `train/checkpoint_files.py`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dspark_ds import distributed
from dspark_ds.config import CheckpointConfig
from dspark_ds.distributed import print0
from dspark_ds.engine.checkpoint import (
    convert_to_universal,
    enable_universal_load,
    load_tag,
    save_tag,
)
from dspark_ds.engine.config import zero_stage
from dspark_ds.errors import ConfigError, TrainingStopped
from dspark_ds.files import first_line
from dspark_ds.train import checkpoint_files as ckpt
from dspark_ds.train import resume as resume_rules
from dspark_ds.train.rng import rng_state, set_rng_state

HASH_ON_RESUME_BYTES_PER_RANK = 4 * 2**30
"""checkpoint.verify auto: sha256 up to this much per rank (a few seconds at disk speed)."""


def slurm_kill_wait_s() -> int | None:
    """KillWait of the cluster the job runs on (`scontrol show config`), None when unknown."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait":
            try:
                return int(value.split()[0])
            except (ValueError, IndexError):
                return None
    return None


@dataclass
class Resume:
    """The checkpoint a run continues from, and what it says about the run that wrote it."""

    tag_dir: Path
    """The verified tag."""
    load_dir: Path
    """What DeepSpeed loads: the tag, or its universal form (another world size)."""
    ds_config: dict
    """The DeepSpeed config the engine is built with to load `load_dir`."""
    meta: dict
    """The tag's meta.json: step, world size, ZeRO stage, the learning-rate schedule."""
    saved_config: dict
    """The run config that wrote it (its run_config.yaml, as plain data)."""
    run_config: dict
    """This run's config, as plain data."""
    changes: dict[str, tuple]
    """The options this run changes, as the resume rules allow: {option: (saved, now)}."""

    @property
    def step(self) -> int:
        return int(self.meta["step"])


class CheckpointManager:
    """The run's checkpoints under <run_dir>/checkpoints (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, rank: int, world: int):
        self.cfg = cfg
        self.dir = Path(run_dir) / "checkpoints"
        self.rank, self.world = rank, world
        self.resume: Resume | None = None
        self.saved_step: int | None = None
        """The step of the checkpoint this process saved or resumed from last."""
        self._engine = self._data = self._run = None
        self._files: dict[str, str] = {}
        self._kill_wait_checked = False

    def attach(self, engine, *, data, run, files: dict[str, str]) -> None:
        """The run's parts, once built: `engine` (a DrafterEngine), `data` (the batch source)
        and `run` (the trainer), each with `state_dict` / `load_state_dict` but the engine;
        `files`: {name: text} rank 0 writes into every tag (the configs)."""
        self._engine, self._data, self._run, self._files = engine, data, run, dict(files)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (the one `latest` names), or None."""
        tag = ckpt.latest_tag(self.dir)
        return None if tag is None else self.dir / tag

    # ---- cadence -------------------------------------------------------------------------------
    def should_save(self, step: int, *, last_step: bool) -> bool:
        if last_step:
            return self.cfg.save_final
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    # ---- resume --------------------------------------------------------------------------------
    def find_resume(self, run_config: dict, draft_config: dict, ds_config: dict) -> Resume | None:
        """Collective. The checkpoint to resume from (see the module docstring), or None to
        start fresh. `run_config`: this run's config as plain data; `draft_config`: the record
        of the drafter it builds (draft_config.json); `ds_config`: its DeepSpeed config."""
        tag_dir = self._choose()
        if tag_dir is None:
            return None
        changes = resume_rules.check(tag_dir, run_config, draft_config, ds_config)
        allowed = {k: v for k, v in changes.allowed().items() if k != "checkpoint.resume"}
        if allowed:
            print0(f"[train] resuming with changed options: {resume_rules.describe(allowed)}")
        meta = json.loads((tag_dir / "meta.json").read_text())
        saved = yaml.safe_load((tag_dir / "run_config.yaml").read_text()) or {}
        load_dir, ds_config = self._loadable(tag_dir, meta, ds_config)
        self.resume = Resume(tag_dir, load_dir, ds_config, meta, saved, run_config, allowed)
        return self.resume

    def _choose(self) -> Path | None:
        """Collective. The verified tag directory to resume from, or None.

        checkpoint.resume null refuses a run directory that already holds checkpoints; "auto"
        and a run / checkpoints directory take the newest complete tag that passes verification
        (a tag without COMPLETE or one that fails is named, and the next older one tried); a
        tag directory must pass itself. ConfigError (exit 2) when nothing usable is left."""
        resume = self.cfg.resume
        if resume is None:
            existing = ckpt.complete_tags(self.dir)
            if existing:
                raise ConfigError(
                    f"checkpoint.resume: {self.dir} already holds {existing[-1]}; pass "
                    "--checkpoint.resume auto to continue it, or choose another --name"
                )
            return None
        path = self.dir if resume == "auto" else Path(resume)
        if _is_tag_dir(path):
            if not (path / ckpt.COMPLETE).exists():
                raise ConfigError(
                    f"checkpoint.resume: {path} has no {ckpt.COMPLETE} marker (its save did not "
                    "finish); pass the run directory to use its newest complete checkpoint"
                )
            problems = self.verify(path)
            if problems:
                raise ConfigError(
                    f"checkpoint.resume: {path} is damaged: {'; '.join(problems[:4])}; pass the "
                    "run directory to fall back to its newest intact checkpoint"
                )
            chosen, damaged = path, set()
        else:
            root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
            chosen, damaged = self._newest_intact(root)
        # NOTE: every rank decided from what it sees; rank 0's choice is the job's (a rank that
        # saw otherwise would load another step and the collectives would stall)
        agreed = distributed.broadcast_object(None if chosen is None else str(chosen))
        if (None if chosen is None else str(chosen)) != agreed:
            distributed.log(f"[train] this rank chose {chosen}, rank 0 {agreed}: taking rank 0's")
        chosen = None if agreed is None else Path(agreed)
        if chosen is not None and chosen.parent.resolve() == self.dir.resolve():
            self._set_aside_newer(chosen, damaged)
        return chosen

    def _newest_intact(self, root: Path) -> tuple[Path | None, set[Path]]:
        tags = []
        if root.is_dir():
            tags = sorted(
                (p for p in root.iterdir() if ckpt.TAG_RE.match(p.name) and p.is_dir()),
                key=lambda p: ckpt.tag_step(p.name),
                reverse=True,
            )
        damaged: list[tuple[Path, list[str]]] = []
        chosen = None
        for tag in tags:
            if not (tag / ckpt.COMPLETE).exists():
                print0(
                    f"[train] skipping {tag.name}: no {ckpt.COMPLETE} marker (a save that did "
                    "not finish)"
                )
                continue
            problems = self.verify(tag)
            if not problems:
                chosen = tag
                break
            damaged.append((tag, problems))
            print0(f"[train] skipping {tag.name}: damaged ({'; '.join(problems[:4])})")
        if chosen is None:
            if damaged:
                raise ConfigError(
                    f"checkpoint.resume: no intact checkpoint in {root}: "
                    + "; ".join(f"{t.name}: {p[0]}" for t, p in damaged)
                )
            if self.cfg.resume != "auto":
                raise ConfigError(f"checkpoint.resume: {root} holds no complete checkpoint")
            return None, set()
        if damaged:
            print0(f"[train] falling back to {chosen.name}, the newest intact checkpoint")
        return chosen, {t for t, _ in damaged}

    def _set_aside_newer(self, chosen: Path, damaged: set[Path]) -> None:
        """Complete tags newer than the one this run continues from belong to a continuation
        that is being replaced (damaged ones, or ones an explicit older resume skips): renamed,
        so that nothing loads or prunes them by mistake, and nothing is deleted."""
        newer = [
            p
            for p in self.dir.iterdir()
            if ckpt.TAG_RE.match(p.name)
            and (p / ckpt.COMPLETE).exists()
            and ckpt.tag_step(p.name) > ckpt.tag_step(chosen.name)
        ]
        if self.rank == 0:
            for tag in sorted(newer):
                why = "damaged" if tag in damaged else "abandoned"
                moved = ckpt.set_aside(tag, why)
                print0(
                    f"[train] {tag.name} set aside as {moved.name} (this run continues from "
                    f"{chosen.name})"
                )
        distributed.barrier()

    def verify(self, tag_dir: Path) -> list[str]:
        """Collective. What is wrong with `tag_dir` against its manifest (see checkpoint.verify);
        the ranks split the hashing."""
        manifest = ckpt.read_manifest(tag_dir)
        names = sorted(manifest["files"])
        total = sum(int(r.get("size", 0)) for r in manifest["files"].values())
        mode = self.cfg.verify
        hashing = mode == "sha256" or (
            mode == "auto" and total / self.world <= HASH_ON_RESUME_BYTES_PER_RANK
        )
        mine = set(names[self.rank :: self.world]) if hashing else set()
        found = distributed.all_gather_object(ckpt.check_files(tag_dir, manifest, mine))
        return list(dict.fromkeys(p for rank_problems in found for p in rank_problems))

    def _loadable(self, tag_dir: Path, meta: dict, ds_config: dict) -> tuple[Path, dict]:
        """Collective. Same world size (or ZeRO-0): the tag itself. Otherwise DeepSpeed's
        universal checkpoint, converted once by rank 0, and a ds config that loads it."""
        if meta["world_size"] == self.world or zero_stage(ds_config) == 0:
            return tag_dir, ds_config
        universal = Path(f"{tag_dir}_universal")
        if self.rank == 0 and not (universal / ckpt.COMPLETE).exists():
            print0(
                f"[train] world size {meta['world_size']} -> {self.world}: converting "
                f"{tag_dir} to a universal checkpoint"
            )
            convert_to_universal(tag_dir, universal)
            (universal / ckpt.COMPLETE).write_text("ok\n")
        distributed.barrier()
        return universal, enable_universal_load(ds_config)

    def load(self) -> None:
        """Collective. Every attached part as the resumed checkpoint left it (nothing when the
        run starts fresh): the engine, the run state, the data position (at the same fraction
        of the epoch when world size x data.batch_size changed), the RNG (same world size)."""
        resume = self.resume
        if resume is None:
            return
        state = load_tag(self._engine.ds, resume.load_dir.parent, resume.load_dir.name)
        self.saved_step = resume.step
        self._run.load_state_dict(state)
        self._data.load_state_dict(self._data_state(state))
        if state["world_size"] == self.world:
            set_rng_state(state["rng"])
        print0(
            f"[train] resumed from {resume.load_dir} at step {state['step']} "
            f"(epoch {state['epoch']})"
        )

    def _data_state(self, state: dict) -> dict:
        data = dict(state["data"])
        per_step_before = int(self.resume.saved_config["data"]["batch_size"]) * state["world_size"]
        per_step_now = int(self.resume.run_config["data"]["batch_size"]) * self.world
        if "samples_consumed" not in data and per_step_before != per_step_now:
            # NOTE: the data package's loader counts batches and its order depends on the world
            # size and micro-batch; continue at the same fraction of the epoch (no sample is
            # repeated twice in a row, the order differs).
            data["position"] = data["position"] * per_step_before // per_step_now
            data["world_size"] = self.world
            print0(
                "[train] WARNING: world size x data.batch_size changed; the data order within "
                "the epoch differs"
            )
        return data

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Collective. Writes tag `step`: rank 0 the attached `files` and meta.json, every rank
        its DeepSpeed files with the run state, the data position and the RNG as DeepSpeed's
        client state; records size and sha256 of every file in MANIFEST.json, then COMPLETE and
        `latest`. A failure on any rank (disk full, I/O error) removes the partial tag and
        raises TrainingStopped on every rank; the previous checkpoint stays intact."""
        run = self._run.state_dict()
        meta = {
            "step": step,
            "world_size": self.world,
            "zero_stage": self._engine.zero_stage,
            "schedule": run["schedule"],
        }
        files = {**self._files, "meta.json": json.dumps(meta)}
        client_state = {
            **run,
            "data": self._data.state_dict(),
            "rng": rng_state(),
            "world_size": self.world,
        }
        return self._write(step, files, client_state)

    def _write(self, step: int, files: dict[str, str], client_state: dict) -> Path:
        tag = ckpt.tag_for_step(step)
        tag_dir = self.dir / tag
        if self.saved_step == step and (tag_dir / ckpt.COMPLETE).exists():
            return tag_dir
        t0 = time.perf_counter()
        error = None
        if self.rank == 0:
            try:
                if tag_dir.exists():  # a save of this step that did not finish
                    ckpt.remove_tag(tag_dir)
                tag_dir.mkdir(parents=True)
                for name, text in files.items():
                    ckpt.atomic_write(tag_dir / name, text)
            except OSError as err:
                error = err
        self._agree(error, tag_dir)
        own: dict[str, dict] = {}
        try:
            save_tag(self._engine.ds, self.dir, tag, client_state)
            names = [
                n
                for n in ckpt.payload_files(tag_dir)
                if ckpt.file_owner(n, self.world) == self.rank
            ]
            own = ckpt.describe_files(tag_dir, names)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
            error = err
        self._agree(error, tag_dir)
        described = distributed.gather_object(own)
        if self.rank == 0:
            try:
                merged = {k: v for part in described for k, v in part.items()}
                rest = [n for n in ckpt.payload_files(tag_dir) if n not in merged]
                merged.update(ckpt.describe_files(tag_dir, rest))
                ckpt.write_manifest(tag_dir, merged, step)
                ckpt.publish(self.dir, tag, self.cfg.keep_last)
            except OSError as err:
                error = err
        self._agree(error, tag_dir)
        self.saved_step = step
        if self.rank == 0:
            size = sum(p.stat().st_size for p in tag_dir.iterdir() if p.is_file())
            took = time.perf_counter() - t0
            print0(f"[train] checkpoint {tag_dir} ({size / 2**20:.1f} MiB, {took:.1f} s)")
            self._warn_if_slower_than_kill_wait(took)
        return tag_dir

    def _warn_if_slower_than_kill_wait(self, save_s: float) -> None:
        """Slurm stops a job with TERM, then KILL after KillWait: a save that takes longer does
        not finish there. Said once per run, under Slurm."""
        if self._kill_wait_checked or not os.environ.get("SLURM_JOB_ID"):
            return
        self._kill_wait_checked = True
        kill_wait = slurm_kill_wait_s()
        if kill_wait is not None and save_s > 0.8 * kill_wait:
            print0(
                f"[train] warning: a checkpoint took {save_s:.0f} s and Slurm's KillWait is "
                f"{kill_wait} s: a TERM from Slurm (scancel, scontrol requeue, a time limit "
                "without --signal=B:USR1@<s>) kills the job before its checkpoint is written, "
                "losing the steps since the last one; keep the USR1 warning's lead time above "
                "the save time (docs/multi-node.md, site settings)"
            )

    def _agree(self, error: BaseException | None, tag_dir: Path) -> None:
        """Collective: every rank learns whether any rank failed; if so the partial tag goes
        (it would only take space) and every rank raises the same TrainingStopped."""
        errors = distributed.all_gather_object(None if error is None else _one_line(error))
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        if self.rank == 0:
            ckpt.remove_tag(tag_dir)
        distributed.barrier()
        previous = ckpt.latest_tag(self.dir)
        rank, why = failed[0]
        where = f" (rank {rank})" if self.world > 1 else ""
        kept = (
            f"the previous checkpoint {self.dir / previous} is intact; free space and resume "
            "with --checkpoint.resume auto"
            if previous
            else "there is no earlier checkpoint"
        )
        raise TrainingStopped(
            f"checkpoint {tag_dir.name} could not be written{where}: {why}; {kept}"
        )


def _is_tag_dir(path: Path) -> bool:
    return (
        bool(ckpt.TAG_RE.match(path.name))
        or (path / ckpt.COMPLETE).exists()
        or (path / "meta.json").exists()
    )


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}[Errno {err.errno}] {err.strerror}"

    return first_line(err)
