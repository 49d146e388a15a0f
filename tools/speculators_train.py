"""speculators 0.9's own trainer on CPU, for tools/peer_compare.py; run by the Python of the
speculators environment (tools/install.sh makes it). It imports nothing of dspark-ds.

    python tools/speculators_train.py JOBS.json

JOBS.json: {"jobs": [job, ...]}, trained one after the other in this process; a job: {"type": speculators_model_type, "config_dir": a directory holding a speculators
config.json (the drafter's architecture), "target": the verifier's directory, "features": a
torch file of training sequences ({"sequences": [{"input_ids", "loss_mask", "hidden_states",
"verifier_last_hidden_states"}, ...]}), "out": the output directory, "steps", "sequences_per_step",
"total_seq_len", "lr", "warmup_ratio", "max_anchors", "ttt_steps", "seed", "threads"}.

What runs is speculators' own: its TrainConfig resolves every option the job does not set to
the kind's defaults (loss, per-position weights, optimizer: Muon for the matrices and AdamW for
the rest, weight decay), `get_trainer_kwargs` turns them into the forward's loss settings, its
`Trainer` runs the loop (autocast, gradient clipping at 1.0, its optimizers and schedulers, its
checkpointer), its `CollateFn` packs the sequences (with Eagle3's `shift_batch`), and the
model is built by its config-only path (`_build_from_config_only`: its own init, the verifier's
embedding, lm_head and norm loaded from the target). The CPU shim changes five things:

1. the device: the trainer's `get_local_rank()` (a CUDA index) is "cpu", and its autocast's
   device type is "cpu";
2. `torch.accelerator.synchronize()` (the step timer's) does nothing when there is no
   accelerator (torch raises there);
3. attention is "eager" (its default, simple_flex_attention, is compiled for GPUs);
4. hidden states and autocast in float32 (its default is bfloat16), as the demo trains ours;
5. the loss implementation is "eager" (its default, "fused", is a Triton kernel for GPUs; the
   same terms).

Written: `out`/model (the trained drafter in fp32, `save_pretrained`; its checkpointer's own
bf16 copy stays under `out`/checkpoints), `out`/train_log.jsonl (loss per step) and
`out`/result.json (steps, seconds, the resolved options).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def resolved_options(job: dict) -> dict:
    """speculators' own TrainConfig for the job (the kind's defaults for the rest), flat."""
    # lazy: speculators is importable in its own environment only (and slow to import)
    from speculators.train.config.schema import TrainConfig

    cfg = TrainConfig.model_validate(
        {
            "speculator_type": job["type"],
            "optimizer": {"lr": job["lr"]},
            "scheduler": {
                "scheduler_type": "cosine",
                "scheduler_warmup_ratio": job["warmup_ratio"],
            },
            "trainer": {
                "epochs": 1,
                "max_steps": job["steps"],
                "save_path": str(Path(job["out"]) / "checkpoints"),
                "no_resume_from_checkpoint": True,
                "log_freq": 10,
            },
            "data": {
                "total_seq_len": job["total_seq_len"],
                "hidden_states_dtype": "float32",
                "max_anchors": job["max_anchors"],
                "num_workers": 0,
            },
            "loss": {"ttt_steps": job["ttt_steps"], "loss_implementation": "eager"},
            "draft": {"draft_attn_impl": "eager"},
            "seed": job["seed"],
        }
    )
    return cfg.flatten()


def trainer_config(model_class, flat: dict):
    """speculators' TrainerConfig from the flat options, as its own CLI builds it."""
    # lazy: speculators is importable in its own environment only (and slow to import)
    from speculators.train.trainer import TrainerConfig

    train_kwargs, val_kwargs = model_class.get_trainer_kwargs(**flat)
    renamed = {
        "num_epochs": flat["epochs"],
        "resume_from_checkpoint": not flat["no_resume_from_checkpoint"],
        "train_call_kwargs": train_kwargs,
        "val_call_kwargs": val_kwargs,
        "hidden_states_dtype": getattr(torch, flat["hidden_states_dtype"]),
    }
    fields = {f: renamed[f] if f in renamed else flat[f] for f in TrainerConfig._fields}
    return TrainerConfig(**fields)


class _Sequences(torch.utils.data.Dataset):
    """The job's sequences in speculators' per-sample layout (BaseDataset's), `count` of them
    in a seeded order (cycling through the set when the budget reads more)."""

    def __init__(self, sequences: list[dict], count: int, seed: int):
        self.sequences = sequences
        g = torch.Generator().manual_seed(seed)
        rounds = -(-count // len(sequences))
        order = torch.cat([torch.randperm(len(sequences), generator=g) for _ in range(rounds)])
        self.order = order[:count].tolist()

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        s = self.sequences[self.order[i]]
        n = int(s["input_ids"].shape[0])
        return {
            "hidden_states": s["hidden_states"].float(),
            "input_ids": s["input_ids"].long(),
            "verifier_last_hidden_states": s["verifier_last_hidden_states"].float(),
            "loss_mask": s["loss_mask"].long(),
            "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n),
        }


def data_loader(job: dict, model, flat: dict):
    # lazy: speculators is importable in its own environment only (and slow to import)
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    sequences = torch.load(job["features"])["sequences"]
    per_step = int(job["sequences_per_step"])
    dataset = _Sequences(sequences, per_step * int(job["steps"]), int(job["seed"]))
    collate = CollateFn(
        max_len=int(flat["total_seq_len"]),
        hidden_size=model.config.transformer_layer_config.hidden_size,
        num_target_layers=len(model.target_layer_ids),
        dtype=torch.float32,
        preprocess=shift_batch if flat["speculator_type"] == "eagle3" else None,
    )
    return torch.utils.data.DataLoader(dataset, batch_size=per_step, collate_fn=collate)


def install_cpu_shim() -> None:
    """The shim's changes 1 and 2 (the module docstring)."""
    # lazy: speculators is importable in its own environment only (and slow to import)
    import speculators.train.trainer as trainer_module

    trainer_module.get_local_rank = lambda: "cpu"
    synchronize = torch.accelerator.synchronize

    def synchronize_if_any(*args, **kwargs):
        if torch.accelerator.current_accelerator() is not None:
            synchronize(*args, **kwargs)

    torch.accelerator.synchronize = synchronize_if_any


def build_model(job: dict, flat: dict):
    # lazy: speculators is importable in its own environment only (and slow to import)
    from speculators import SpeculatorModel
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train.cli import _build_from_config_only, set_seed

    set_seed(int(flat["seed"]))
    if not flat["draft_mrope_full_head_hack"]:  # as its CLI does
        install_partial_neox_rotary()
    model_class = SpeculatorModel.registry[flat["speculator_type"]]
    model = _build_from_config_only(
        model_class,
        job["config_dir"],
        None,
        None,
        verifier_name_or_path=job["target"],
        draft_attn_impl=flat["draft_attn_impl"],
    )
    return model_class, model


def log_losses(out: Path):
    """Its metric logger's records (one per log step) appended to `out`/train_log.jsonl, until
    the returned handler is removed."""
    # lazy: the logging module is only needed once the run is set up
    import logging

    class _ToFile(logging.Handler):
        def emit(self, record):
            msg = record.msg
            if isinstance(msg, dict) and "train" in msg:
                row = {"step": msg.get("global_step"), "lr": msg.get("lr"), **msg["train"]}
                with (out / "train_log.jsonl").open("a") as f:
                    f.write(json.dumps(row, default=float) + "\n")

    metrics = logging.getLogger("speculators.metrics")
    metrics.setLevel(logging.INFO)
    handler = _ToFile()
    metrics.addHandler(handler)
    return metrics, handler


def run_job(job: dict) -> dict:
    """One drafter trained by speculators' Trainer; its result.json."""
    torch.set_num_threads(int(job.get("threads", 1)))
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_log.jsonl").unlink(missing_ok=True)
    # lazy: speculators is importable in its own environment only (and slow to import)
    from speculators.train.trainer import Trainer

    flat = resolved_options(job)
    model_class, model = build_model(job, flat)
    loader = data_loader(job, model, flat)
    logger, handler = log_losses(out)
    trainer = Trainer(model, trainer_config(model_class, flat), loader, None)
    trainer.device_type = "cpu"
    t0 = time.perf_counter()
    try:
        trainer.run_training()
    finally:
        logger.removeHandler(handler)
    seconds = time.perf_counter() - t0
    model.save_pretrained(out / "model")
    keys = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "loss_fn")
    keys += ("per_position_loss_weight", "dflash_decay_gamma", "scheduler_type", "max_anchors")
    keys += ("scheduler_warmup_ratio", "ttt_steps", "ttt_step_loss_decay", "total_seq_len", "seed")
    result = {
        "steps": trainer.global_step,
        "train_s": seconds,
        "options": {k: flat[k] for k in keys},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    install_cpu_shim()
    for job in json.loads(Path(sys.argv[1]).read_text())["jobs"]:
        print(json.dumps({"out": job["out"], **run_job(job)}), flush=True)


if __name__ == "__main__":
    main()
