"""Where the trainer's batches come from. The trainer only needs a *batch source*:

    source.set_epoch(e); for batch in source: ...       # this rank's micro-batches, in order
    len(source)                                          # micro-batches per epoch per rank
    source.state_dict() / source.load_state_dict(s)      # (epoch, position): exact resume

Batches follow the feature contract (brief; `dspark_ds.target`): input_ids, loss_mask,
attention_mask, sample_ids, target_hidden_states, target_last_hidden_states.

Two sources: the data package's loader (offline cache / online target / hybrid) and
`SyntheticSource`, random token sequences whose features the target computes online. The
synthetic order is global (rank r takes its slice of each global micro-batch), so its
position survives a change of world size exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from dspark_ds import distributed
from dspark_ds.data.loader import EpochCursor, build_train_loader
from dspark_ds.data.served import connect
from dspark_ds.errors import ConfigError
from dspark_ds.target import TargetFeatureProvider


class SyntheticSource(EpochCursor):
    """`num_samples` sequences of length `seq_len`, deterministic per (seed, sample id).

    Each sample repeats a short random motif (so the next token is predictable from context
    and a drafter can learn), starts with an unsupervised prompt of a quarter of its length,
    and has a random length in [seq_len/2, seq_len] (right padding exercises the masks).
    """

    def __init__(
        self,
        *,
        num_samples: int,
        seq_len: int,
        vocab_size: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        provider: TargetFeatureProvider | None,
        sample_offset: int = 0,
    ):
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.batch_size, self.rank, self.world = batch_size, rank, world_size
        self.seed, self.provider, self.sample_offset = seed, provider, sample_offset
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return self.num_samples // (self.batch_size * self.world)

    def state_dict(self) -> dict:
        # NOTE: position in *samples*, not batches: valid for any world size.
        return {
            "epoch": self.epoch,
            "samples_consumed": self.position * self.batch_size * self.world,
        }

    def load_state_dict(self, state: dict) -> None:
        per_batch = self.batch_size * self.world
        consumed = int(state["samples_consumed"])
        if consumed % per_batch:
            raise ConfigError(
                f"cannot resume the synthetic order: {consumed} samples consumed is "
                f"not a multiple of data.batch_size × world size = {per_batch}"
            )
        self.epoch, self.position = int(state["epoch"]), consumed // per_batch

    def sample(self, sample_id: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.sample_offset + sample_id)
        length = int(torch.randint(self.seq_len // 2, self.seq_len + 1, (1,), generator=g))
        motif_len = int(torch.randint(3, 9, (1,), generator=g))
        motif = torch.randint(0, self.vocab_size, (motif_len,), generator=g)
        ids = motif.repeat(length // motif_len + 1)[:length]
        loss_mask = torch.ones(length, dtype=torch.long)
        loss_mask[: max(1, length // 4)] = 0
        return {"input_ids": ids, "loss_mask": loss_mask}

    def _batch(self, sample_ids: list[int]) -> dict:
        samples = [self.sample(i) for i in sample_ids]
        seq = max(len(s["input_ids"]) for s in samples)
        bsz = len(samples)
        batch = {
            "input_ids": torch.zeros(bsz, seq, dtype=torch.long),
            "loss_mask": torch.zeros(bsz, seq, dtype=torch.long),
            "attention_mask": torch.zeros(bsz, seq, dtype=torch.long),
            "sample_ids": torch.tensor(sample_ids, dtype=torch.long) + self.sample_offset,
        }
        for b, s in enumerate(samples):
            n = len(s["input_ids"])
            batch["input_ids"][b, :n] = s["input_ids"]
            batch["loss_mask"][b, :n] = s["loss_mask"]
            batch["attention_mask"][b, :n] = 1
        return self.provider(batch) if self.provider is not None else batch

    def __iter__(self) -> Iterator[dict]:
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        perm = torch.randperm(self.num_samples, generator=g).tolist()
        per_batch = self.batch_size * self.world
        while self.position < len(self):
            start = self.position * per_batch + self.rank * self.batch_size
            ids = perm[start : start + self.batch_size]
            self.position += 1
            yield self._batch(ids)


def build_batch_source(
    cfg, *, rank: int, world_size: int, target, draft_config, split: str = "train", served=None
):
    """The batch source of `cfg` (a TrainRunConfig) for this rank; None when `split` is "val"
    and no held-out data is configured. `served`: the fleet's client and its `ServedTarget`
    (`served_client`), when the target is served."""
    provider = TargetFeatureProvider(target) if target is not None else None
    if cfg.train.synthetic_samples > 0:
        if split == "val" and (cfg.validation.paths or cfg.validation.cache_dir):
            pass  # real held-out data below
        else:
            num = cfg.train.synthetic_samples
            if split == "val":
                num = cfg.validation.num_batches * cfg.data.batch_size * world_size
            return SyntheticSource(
                num_samples=num,
                seq_len=cfg.data.max_length,
                vocab_size=int(draft_config.vocab_size),
                batch_size=cfg.data.batch_size,
                rank=rank,
                world_size=world_size,
                seed=cfg.train.seed,
                provider=provider,
                # held-out ids never collide with training ids
                sample_offset=0 if split == "train" else 10**9,
            )

    data_cfg = cfg.data
    if split == "val":
        if not (cfg.validation.paths or cfg.validation.cache_dir):
            return None
        mode = "offline" if cfg.validation.cache_dir else "online"
        if mode == "online" and served is not None:  # the training data's servers
            mode = "served"
        data_cfg = replace(
            cfg.data,
            paths=list(cfg.validation.paths),
            cache_dir=cfg.validation.cache_dir,
            mode=mode,
        )
    client, served_target = served if served is not None else (None, None)
    return build_train_loader(
        data_cfg,
        rank,
        world_size,
        target if served is None else served_target,
        hidden_size=int(draft_config.hidden_size),
        layer_ids=list(draft_config.target_layer_ids),
        vocab_size=int(draft_config.vocab_size),
        served=client if data_cfg.mode in ("served", "hybrid") else None,
    )


def served_client(cfg, draft_config, lm_head):
    """(this rank's client of the target's fleet, the `ServedTarget`) when `cfg`'s features come
    from servers (data.mode served, or hybrid with data.served.urls), else None."""
    data = cfg.data
    if cfg.train.synthetic_samples > 0 or not data.from_servers:
        return None

    layer_ids = list(draft_config.target_layer_ids)
    return connect(data, cfg.target, layer_ids, lm_head, say=distributed.log)
