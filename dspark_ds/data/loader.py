"""The training loader: one feature contract, four modes (offline / online / hybrid / served).

Every mode yields the same batches for the same samples and seed: the sample order depends
only on (seed, epoch, rank, world size, lengths), and features come from the cache (offline,
hybrid epochs ≥ 1), from the frozen target in the job (online, hybrid epoch 0) or from the
target's vLLM servers (served, and hybrid epoch 0 with ``data.served.urls``; `served.py`).
Batch keys: ``input_ids``, ``loss_mask``, ``attention_mask`` (long [B,S]), ``sample_ids`` [B],
``target_hidden_states`` [B,S,n·H], ``target_last_hidden_states`` [B,S,H].
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from dspark_ds import distributed as dist
from dspark_ds.data import cache as cache_lib
from dspark_ds.data import cache_writer
from dspark_ds.data.collate import Collator, split_batch
from dspark_ds.data.config import DataConfig
from dspark_ds.data.served import ServedFeatures, ServedTarget
from dspark_ds.data.tokens import TokenStore, load_samples
from dspark_ds.errors import ConfigError
from dspark_ds.target import FrozenTarget, TargetFeatureProvider

PROBE_TOKENS = 32
"""The start-up check of a served target sends the first sample's first tokens."""


def epoch_batches(
    lengths: list[int],
    batch_size: int,
    rank: int,
    world: int,
    seed: int,
    epoch: int,
    length_grouping: int = 64,
) -> list[list[int]]:
    """This rank's micro-batches (sample indices) for ``epoch``, deterministic.

    A seeded permutation is cut into global batches of ``batch_size · world`` (the tail that
    does not fill one is left out this epoch, so every rank takes the same number of steps);
    windows of ``length_grouping`` global batches are sorted by length so a batch holds
    similar lengths (less padding), and the batch order is shuffled again.
    """
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    perm = torch.randperm(len(lengths), generator=g).tolist()
    global_bs = batch_size * world
    num_steps = len(perm) // global_bs
    perm = perm[: num_steps * global_bs]
    window = global_bs * length_grouping
    if length_grouping > 1:
        perm = [
            i
            for w in range(0, len(perm), window)
            for i in sorted(perm[w : w + window], key=lambda j: -lengths[j])
        ]
    global_batches = [perm[k * global_bs : (k + 1) * global_bs] for k in range(num_steps)]
    order = (
        torch.randperm(num_steps, generator=g).tolist() if length_grouping > 1 else range(num_steps)
    )
    return [global_batches[k][rank * batch_size : (rank + 1) * batch_size] for k in order]


class _Subset(torch.utils.data.Dataset):
    def __init__(self, source):
        self.source = source

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        return self.source[i]


class HybridCacheWriter:
    """Hybrid mode: stores the features computed in epoch 0, then completes the cache.

    Rank ``r`` writes shards ``h<r>-<k>``; after epoch 0 the samples nobody wrote (the tail
    left out of epoch 0, or batches lost to a restart) are computed, split across ranks, and
    rank 0 writes the manifest. Needs ``cache_dir`` on a file system every rank sees.
    """

    def __init__(
        self, cache_dir: str, header: dict, samples_per_shard: int, storage: str, num_taps: int
    ):
        self.cache_dir, self.storage, self.num_taps = cache_dir, storage, num_taps
        self.per_shard = samples_per_shard
        self.rank, self.world = dist.rank_and_world()
        self.complete = cache_writer.begin_build(cache_dir, header)
        mine = [
            n for n in cache_lib.completed_shards(cache_dir) if n.startswith(f"h{self.rank:05d}-")
        ]
        self.next_shard = len(mine)
        self.buffer: list[dict] = []

    def add(self, batch: dict) -> None:
        if self.complete:
            return
        self.buffer += split_batch(batch)
        if len(self.buffer) >= self.per_shard:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.buffer.sort(key=lambda s: s["sample_id"])
            cache_writer.write_shard(
                self.cache_dir,
                f"h{self.rank:05d}-{self.next_shard:06d}",
                self.buffer,
                self.storage,
                self.num_taps,
            )
            self.next_shard += 1
            self.buffer = []

    def finish(self, store: TokenStore, provider, batch_size: int, pad_token_id: int) -> None:
        if self.complete:
            return
        self.flush()
        dist.barrier()
        written = {
            i for s in cache_lib.completed_shards(self.cache_dir).values() for i in s["sample_ids"]
        }
        todo = [i for i in range(len(store)) if i not in written]
        missing = todo[self.rank :: self.world]
        if todo:
            # NOTE: the same number of target forwards on every rank (the short share padded
            # with a repeat): a ZeRO-3 partitioned target all-gathers weights in each forward.
            even = missing + todo[:1] * (-(-len(todo) // self.world) - len(missing))
            feats = cache_writer.compute_features(provider, store, even, batch_size, pad_token_id)
            self.buffer = [feats[i] for i in missing]
            self.flush()
        dist.barrier()
        if self.rank == 0:
            cache_writer.finalize(self.cache_dir)
        dist.barrier()
        self.complete = True


class EpochCursor:
    """Where a batch source stands in its order: `position` micro-batches of epoch `epoch` are
    yielded. Setting another epoch starts it from its first micro-batch."""

    epoch: int = 0
    position: int = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0


class TrainLoader(EpochCursor):
    """Iterate one epoch of this rank's batches; resumable at any batch.

    Use: ``loader.set_epoch(e); for batch in loader: ...``. ``state_dict()`` records
    (epoch, position = batches already yielded in the epoch); after ``load_state_dict`` the
    next iteration continues with the next batch of the same order.
    """

    def __init__(
        self,
        cfg: DataConfig,
        rank: int,
        world_size: int,
        samples: TokenStore | None,
        cache: cache_lib.TargetCache | None,
        provider: TargetFeatureProvider | ServedFeatures | None,
        writer: HybridCacheWriter | None = None,
    ):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.samples, self.cache, self.provider, self.writer = samples, cache, provider, writer
        self.served = provider if isinstance(provider, ServedFeatures) else None
        """The target's fleet (served mode, hybrid's first epoch with ``data.served.urls``)."""
        ref = samples if samples is not None else cache
        self.lengths = ref.lengths
        self.pad_token_id = int(ref.meta.get("pad_token_id", 0))
        self.epoch, self.position = 0, 0
        self._checked_epoch: int | None = None

    def source_for(self, epoch: int) -> str:
        """Where features come from in ``epoch``: "cache" or "target" (in the job or served)."""
        mode = self.cfg.mode
        return "cache" if mode == "offline" or (mode == "hybrid" and epoch >= 1) else "target"

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        e = self.epoch if epoch is None else epoch
        return epoch_batches(
            self.lengths,
            self.cfg.batch_size,
            self.rank,
            self.world,
            self.cfg.seed,
            e,
            self.cfg.length_grouping,
        )

    def __len__(self) -> int:
        return len(self.lengths) // (self.cfg.batch_size * self.world)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.cfg.seed,
            "world_size": self.world,
            "num_samples": len(self.lengths),
        }

    def load_state_dict(self, state: dict) -> None:
        for key, have in (
            ("world_size", self.world),
            ("num_samples", len(self.lengths)),
            ("seed", self.cfg.seed),
        ):
            if state.get(key, have) != have:
                raise ConfigError(
                    f"cannot resume the data order: checkpoint has {key}="
                    f"{state[key]}, this run has {have}"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def _open_cache(self) -> cache_lib.TargetCache:
        if self.cache is None:
            if self.writer is not None and self.samples is not None:
                self.writer.finish(
                    self.samples, self.provider, self.cfg.batch_size, self.pad_token_id
                )
            self.cache = cache_lib.TargetCache(self.cfg.cache_dir, self.cfg.cache_verify)
            check_cache_matches(self.cache, self.samples)
        return self.cache

    def _cache_for_epoch(self) -> cache_lib.TargetCache:
        """Collective. The cache, checked again (``cfg.cache_verify``) at the start of every
        epoch after the one it was opened in: a shard damaged since then is named, with the
        repair, instead of being read."""
        cache = self._open_cache()
        if self._checked_epoch is not None and self._checked_epoch != self.epoch:
            cache.verify(self.cfg.cache_verify)
        self._checked_epoch = self.epoch
        return cache

    def __iter__(self) -> Iterator[dict]:
        from_cache = self.source_for(self.epoch) == "cache"
        if not from_cache and self.served is not None:
            yield from self._served_epoch()
            return
        dataset = self._cache_for_epoch() if from_cache else self.samples
        todo = self.batches()[self.position :]
        loader = DataLoader(
            _Subset(dataset),
            batch_sampler=todo,
            collate_fn=Collator(self.pad_token_id),
            num_workers=self.cfg.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
        )
        for batch in loader:
            if not from_cache:
                batch = self.provider(batch)
                if self.writer is not None:
                    self.writer.add(batch)
            elif isinstance(self.provider, TargetFeatureProvider):  # online batches' device
                batch = {
                    k: v.to(self.provider.target.device, non_blocking=True)
                    for k, v in batch.items()
                }
            self.position += 1
            yield batch
        if not from_cache and self.writer is not None:
            self._open_cache()

    def _served_epoch(self) -> Iterator[dict]:
        """This epoch's batches from the fleet, ``data.served.prefetch_batches`` ahead."""
        start, epoch = self.position, self.epoch
        todo = (
            (f"epoch {epoch}, micro-batch {start + k}", [self.samples[i] for i in batch])
            for k, batch in enumerate(self.batches()[start:])
        )
        for batch in self.served.batches(todo, Collator(self.pad_token_id)):
            if self.writer is not None:
                self.writer.add(batch)
            self.position += 1
            yield batch
        if self.writer is not None:
            self._open_cache()


def check_cache_matches(cache: cache_lib.TargetCache, samples: TokenStore | None) -> None:
    fp = samples.meta.get("fingerprint") if samples is not None else None
    if fp is not None and cache.meta["fingerprint"] not in (None, fp):
        raise cache_lib.CacheError(
            f"{cache.cache_dir}: the cache was built from another data "
            "set (fingerprint differs from data.paths)"
        )


def build_train_loader(
    cfg: DataConfig,
    rank: int | None = None,
    world_size: int | None = None,
    target: FrozenTarget | ServedTarget | None = None,
    *,
    hidden_size: int | None = None,
    layer_ids: list[int] | None = None,
    vocab_size: int | None = None,
    served: ServedFeatures | None = None,
) -> TrainLoader:
    """The training loader of this rank for ``cfg.mode``.

    ``target`` (a FrozenTarget on the training device) is required for online and hybrid
    modes; with ``served`` (the fleet's client: served mode, hybrid with ``data.served.urls``)
    it is the `ServedTarget` that describes the served one. ``hidden_size``, ``layer_ids``,
    ``vocab_size`` describe the drafter: an offline cache that does not match them is refused
    here, before training starts.
    """
    if rank is None or world_size is None:
        rank, world_size = dist.rank_and_world()
    if cfg.mode in ("online", "hybrid", "served") and target is None:
        raise ConfigError(f"data.mode={cfg.mode} needs the target model (target.path)")
    if cfg.mode == "served" and served is None:
        raise ConfigError("data.mode=served needs the target's servers (data.served.urls)")
    provider = served
    if provider is None and isinstance(target, FrozenTarget):
        provider = TargetFeatureProvider(target)
    samples = cache = writer = None
    if cfg.mode == "offline":
        cache = cache_lib.TargetCache(cfg.cache_dir, cfg.cache_verify)
        cache.check_compatible(hidden_size=hidden_size, layer_ids=layer_ids, vocab_size=vocab_size)
    else:
        samples = load_samples(cfg, getattr(target, "name_or_path", None))
        if served is not None and len(samples):
            served.check([int(t) for t in samples[0]["input_ids"][:PROBE_TOKENS]])
        if target is not None:
            if layer_ids is not None and list(layer_ids) != list(target.layer_ids):
                raise ConfigError(
                    f"target.layer_ids {target.layer_ids} != drafter "
                    f"target_layer_ids {list(layer_ids)}"
                )
        if cfg.mode == "hybrid":
            storage = (
                cfg.cache_dtype
                if cfg.cache_dtype != "auto"
                else str(target.dtype).removeprefix("torch.")
            )
            header = cache_writer.make_header(target, samples, storage)
            writer = HybridCacheWriter(
                cfg.cache_dir, header, cfg.samples_per_shard, storage, len(target.layer_ids)
            )
            if (Path(cfg.cache_dir) / "manifest.json").exists() and writer.complete:
                manifest = json.loads((Path(cfg.cache_dir) / "manifest.json").read_text())
                dist.print0(
                    f"[data] hybrid cache complete ({manifest['num_samples']} "
                    "samples); epochs >= 1 read it"
                )
    return TrainLoader(cfg, rank, world_size, samples, cache, provider, writer)
