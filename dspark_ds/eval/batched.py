"""Batched speculative decoding: several prompts in flight, each with its own acceptance.

Layout. The rows of a batch share one target KV cache (Hugging Face `DynamicCache`) and one
drafter cache (`DraftKVCache`), both *left-padded*: row r's verified positions [0, start_r)
occupy the last start_r cache columns, and `pad[r]` columns of zeros precede them. Cache index i
of row r holds position i - pad[r], so relative distances, and with them sliding windows
(Gemma4), are those of an unpadded row; a 2-D attention mask hides the padding and RoPE gets the
real positions.

One round for R rows:

1. draft: DSpark / DFlash run one block per row against the cached context; Eagle3 chains γ
   single-token steps from the last verified hidden state of each row;
2. choose each row's proposal length m_r: γ, the static confidence threshold, or the paper's
   hardware-aware prefix scheduler (Algorithm 1, `schedule_prefixes`), then the budget;
3. verify [x_start, d_1 .. d_M] (M = max m_r; a shorter row's extra drafts are computed and
   discarded) in one target forward, greedy or by rejection sampling, row by row;
4. trim: row r keeps x_start and its a_r accepted drafts. Its rejected columns are dropped by
   shifting the row right by (its drop - the smallest drop) and cropping the smallest drop off
   every row: the row stays right-aligned and its padding grows. The drafter's cache gets the
   verified features and the same trim, so both caches keep one layout.

Finished rows leave the batch and queued prompts take their place (each prefilled alone, then
left-padded into the batch), so the batch stays full until the queue is empty.

The target alone is the same loop with no drafter (m_r = 0): `dspark-ds eval --batch_size N`
compares the two at the same batch size, on the same machine, in the same run.

Shape legend: R rows in flight, S cache columns, G = γ, M verified drafts, V vocab, H hidden.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dspark_ds.drafters.common.blocks import DraftKVCache
from dspark_ds.drafters.registry import spec_of
from dspark_ds.eval import verify
from dspark_ds.eval.calibration import confidence_temperatures
from dspark_ds.eval.decoding import DecodeStats, _sync
from dspark_ds.eval.target_step import check_drafter_matches_target, tap_layers

# steps per second of a target forward over R rows of L tokens each
SPS = Callable[[int, int], float]


# ---- left-padded caches ------------------------------------------------------------------------


def _shift_rows_right(x: torch.Tensor, shift_R: torch.Tensor) -> torch.Tensor:
    """x [R, h, T, D]: row r moved right by shift_R[r] columns along T, zeros entering left."""
    if not bool((shift_R > 0).any()):
        return x
    length = x.shape[2]
    src = torch.arange(length, device=x.device).unsqueeze(0) - shift_R.unsqueeze(1)  # [R, T]
    out = x.gather(2, src.clamp(min=0)[:, None, :, None].expand_as(x))
    return out * (src >= 0)[:, None, :, None].to(x.dtype)


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    if n <= 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:2], n, x.shape[3]), x], dim=2)


class _DraftSlots:
    """The per-layer tensors of a `DraftKVCache` (full attention, every column stored)."""

    def __init__(self, cache: DraftKVCache):
        self.cache = cache

    def tensors(self):
        for i, (k, v) in enumerate(zip(self.cache.keys, self.cache.values)):
            if k is not None:
                yield i, k, v

    def put(self, i, k, v):
        self.cache.keys[i], self.cache.values[i] = k, v

    def stored(self, i, total: int) -> int:
        return total

    def set_total(self, total: int) -> None:
        pass

    def crop_end(self, n: int, total: int) -> None:
        self.cache.crop(total - n)

    def layers(self):
        return range(len(self.cache.keys))


class _TargetSlots:
    """The per-layer tensors of a Hugging Face `DynamicCache` (full and sliding-window layers)."""

    def __init__(self, cache: DynamicCache):
        self.cache = cache

    def tensors(self):
        for i, layer in enumerate(self.cache.layers):
            if getattr(layer, "is_initialized", False) and layer.keys is not None:
                yield i, layer.keys, layer.values

    def put(self, i, k, v):
        self.cache.layers[i].keys, self.cache.layers[i].values = k, v

    def stored(self, i, total: int) -> int:
        """Columns a layer keeps when the index space holds `total` (after a crop)."""
        layer = self.cache.layers[i]
        if getattr(layer, "is_sliding", False):
            return min(total, int(layer.sliding_window) - 1)
        return total

    def set_total(self, total: int) -> None:
        for layer in self.cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = total

    def crop_end(self, n: int, total: int) -> None:
        # NOTE: crop(-n) also trims sliding-window layers back to their window (even n = 0).
        self.cache.crop(-n)

    def layers(self):
        return range(len(self.cache.layers))


class PaddedCaches:
    """The target and drafter caches of the rows in flight, left-padded to `length` columns."""

    def __init__(self, target_cache: DynamicCache, draft_cache: DraftKVCache | None):
        self.slots = [_TargetSlots(target_cache)]
        if draft_cache is not None:
            self.slots.append(_DraftSlots(draft_cache))
        self.target_cache, self.draft_cache = target_cache, draft_cache
        self.length = 0
        self.pad: torch.Tensor | None = None  # [R] long

    @property
    def rows(self) -> int:
        return 0 if self.pad is None else int(self.pad.shape[0])

    def key_mask(self) -> torch.Tensor:
        """[R, length] bool: the real (non-padding) columns of each row."""
        cols = torch.arange(self.length, device=self.pad.device)
        return cols.unsqueeze(0) >= self.pad.unsqueeze(1)

    def starts(self) -> torch.Tensor:
        """[R]: each row's number of verified positions (= the position of its x_start)."""
        return self.length - self.pad

    def trim(self, keep_R: torch.Tensor, appended: int) -> None:
        """After `appended` columns were added to every row, keep the first keep_R[r] of them."""
        drop = appended - keep_R
        common = int(drop.min())
        shift = drop - common
        total = self.length + appended
        for slots in self.slots:
            for i, k, v in slots.tensors():
                slots.put(i, _shift_rows_right(k, shift), _shift_rows_right(v, shift))
            slots.crop_end(common, total)
        self.length = total - common
        self.pad = self.pad + shift
        self._drop_common_padding()

    def _drop_common_padding(self) -> None:
        n = int(self.pad.min()) if self.rows else 0
        if n <= 0:
            return
        for slots in self.slots:
            for i, k, v in slots.tensors():
                # a sliding layer keeps only the last columns: cut just what it holds of the n
                cut = max(0, n - (self.length - k.shape[2]))
                slots.put(i, k[:, :, cut:], v[:, :, cut:])
            slots.set_total(self.length - n)
        self.length -= n
        self.pad = self.pad - n

    def _pad_to(self, total: int) -> None:
        n = total - self.length
        if n <= 0:
            return
        for slots in self.slots:
            for i, k, v in slots.tensors():
                extra = slots.stored(i, total) - k.shape[2]
                slots.put(i, _left_pad(k, extra), _left_pad(v, extra))
            slots.set_total(total)
        self.length = total
        self.pad = self.pad + n

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.pad.device)
        for slots in self.slots:
            for i, k, v in slots.tensors():
                slots.put(i, k.index_select(0, index), v.index_select(0, index))
        self.pad = self.pad.index_select(0, index)
        if not rows:
            self.length = 0
        self._drop_common_padding()

    def add(self, other: PaddedCaches) -> None:
        """Append the rows of `other` (a fresh prefill) below the rows in flight."""
        if self.rows == 0:  # adopt the fresh caches as they are
            self.slots, self.length, self.pad = other.slots, other.length, other.pad.clone()
            self.target_cache, self.draft_cache = other.target_cache, other.draft_cache
            return
        total = max(self.length, other.length)
        self._pad_to(total)
        other._pad_to(total)
        for mine, theirs in zip(self.slots, other.slots):
            theirs_tensors = {i: (k, v) for i, k, v in theirs.tensors()}
            for i, k, v in list(mine.tensors()):
                k2, v2 = theirs_tensors[i]
                mine.put(i, torch.cat([k, k2]), torch.cat([v, v2]))
        self.pad = torch.cat([self.pad, other.pad])


# ---- the target ---------------------------------------------------------------------------------


def new_target_cache(target) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    # NOTE: sliding-window layers (Gemma4) would drop old K/V as they go; with past recording
    # they keep them until the next crop, so rejected drafts can be rolled back.
    cache.activate_past_recording()
    return cache


def _cache_kwarg(target) -> str:
    import inspect

    params = inspect.signature(target.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def target_forward(
    target,
    caches: PaddedCaches,
    ids_RL: torch.Tensor,
    layer_ids: list[int],
    logits_to_keep: int = 0,
):
    """Run the target on L new tokens per row, appended after the cached columns.

    Returns (fp32 logits [R, L or logits_to_keep, V], tapped features [R, L, n*H] or None). The
    new columns are in the cache afterwards; `caches.trim` decides which of them stay.
    """
    rows, length = ids_RL.shape
    device = ids_RL.device
    positions = caches.starts().unsqueeze(1) + torch.arange(length, device=device)
    mask = torch.cat([caches.key_mask(), caches.key_mask().new_ones(rows, length)], dim=1)
    out = target(
        input_ids=ids_RL,
        position_ids=positions,
        attention_mask=mask.long(),
        **{_cache_kwarg(target): caches.target_cache},
        use_cache=True,
        output_hidden_states=bool(layer_ids),
        logits_to_keep=logits_to_keep,
    )
    features = tap_layers(out.hidden_states, layer_ids) if layer_ids else None
    return out.logits.float(), features


# ---- the prefix scheduler (paper Algorithm 1) ---------------------------------------------------


def schedule_prefixes(confidences: list[list[float]], sps: SPS) -> list[int]:
    """Verification lengths ℓ_r for R rows from their per-slot confidences c_{r,1..γ}.

    Prefix survival a_{r,j} = Π_{i≤j} c_{r,i}. Candidates (r, j) are admitted in descending
    a_{r,j} (ties: the earlier slot first, so a row's prefix grows in order) while the expected
    throughput Θ = (R + Σ admitted a) · SPS(R, L) rises, L = 1 + max ℓ_r being the tokens per row
    of the (padded) verification forward. The search stops at the first candidate that does not
    raise Θ: no decision ever looks at a later candidate, which keeps decoding lossless.
    """
    rows = len(confidences)
    candidates = []
    for r, conf in enumerate(confidences):
        survival = 1.0
        for j, c in enumerate(conf, start=1):
            survival *= c
            if survival > 0.0:
                candidates.append((-survival, j, r))
    candidates.sort()
    lengths, chosen = [0] * rows, [0] * rows
    expected, longest = float(rows), 1
    best = expected * sps(rows, 1)
    for neg_survival, j, r in candidates:
        lengths[r] = j
        longest = max(longest, j + 1)
        expected -= neg_survival
        theta = expected * sps(rows, longest)
        if theta <= best:
            break
        best, chosen = theta, list(lengths)
    return chosen


@torch.inference_mode()
def profile_sps(
    target,
    *,
    max_rows: int,
    max_tokens: int,
    context_tokens: int,
    layer_ids: list[int],
    repeats: int = 3,
    progress: bool = False,
) -> dict[tuple[int, int], float]:
    """Steps per second of one verification forward over R rows x L tokens, R ≤ max_rows,
    L ≤ max_tokens, each row with `context_tokens` cached positions: the cost table of the
    scheduler, measured once on this machine (median of `repeats` after one warm-up)."""
    from tqdm import tqdm

    device = next(target.parameters()).device
    vocab = int(target.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    table = {}
    bar = tqdm(total=max_rows * max_tokens, desc="profile SPS", disable=not progress)
    for rows in range(1, max_rows + 1):
        caches = PaddedCaches(new_target_cache(target), None)
        caches.pad = torch.zeros(rows, dtype=torch.long, device=device)
        context = torch.randint(0, vocab, (rows, context_tokens), generator=gen).to(device)
        target_forward(target, caches, context, layer_ids, logits_to_keep=1)
        caches.trim(torch.full((rows,), context_tokens, device=device), context_tokens)
        for length in range(1, max_tokens + 1):
            ids = torch.randint(0, vocab, (rows, length), generator=gen).to(device)
            times = []
            for rep in range(repeats + 1):
                _sync(device)
                t0 = time.perf_counter()
                target_forward(target, caches, ids, layer_ids)
                _sync(device)
                if rep:
                    times.append(time.perf_counter() - t0)
                caches.trim(torch.zeros(rows, dtype=torch.long, device=device), length)
            table[(rows, length)] = 1.0 / sorted(times)[len(times) // 2]
            bar.update(1)
    bar.close()
    return table


# ---- the decoding loop --------------------------------------------------------------------------


@dataclass
class _Request:
    index: int
    prompt_1P: torch.Tensor
    stats: DecodeStats
    new_tokens: list[int] = field(default_factory=list)


@dataclass
class BatchedResult:
    """One prompt's output and counters (times are the batch's, shared out among its rows)."""

    index: int
    output_ids: torch.Tensor
    stats: DecodeStats


def _first_stop(tokens: list[int], stops: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stops), None)


class BatchedDecoder:
    """Decodes a queue of prompts with up to `batch_size` in flight; see the module docstring.

    `drafter` None decodes with the target alone (the throughput baseline).
    `policy`: "full" (γ drafts), "threshold" (cut at the first confidence below
    `confidence_threshold`) or "scheduler" (Algorithm 1 with the `sps` cost table).
    """

    def __init__(
        self,
        target,
        drafter,
        *,
        batch_size: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        policy: str = "full",
        confidence_threshold: float = 0.0,
        sps: SPS | None = None,
        generator: torch.Generator | None = None,
        stop_token_ids: list[int] | None = None,
        budget_accounting: str = "exact",
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if policy not in ("full", "threshold", "scheduler"):
            raise ValueError(f"policy must be full | threshold | scheduler, got {policy!r}")
        if budget_accounting not in ("exact", "reference"):
            raise ValueError(
                f"budget_accounting must be exact | reference, got {budget_accounting!r}"
            )
        self.eagle3 = drafter is not None and spec_of(drafter).kind == "eagle3"
        if policy != "full" and getattr(drafter, "confidence_head", None) is None:
            raise ValueError(f"policy {policy!r} needs a drafter with a confidence head")
        if policy == "scheduler" and sps is None:
            raise ValueError("policy 'scheduler' needs the sps cost table")
        if drafter is not None:
            check_drafter_matches_target(target, drafter)
        self.target, self.drafter = target, drafter
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.temperature, self.policy = temperature, policy
        self.threshold, self.sps, self.generator = confidence_threshold, sps, generator
        self.stops = {int(t) for t in (stop_token_ids or [])}
        self.exact = budget_accounting == "exact"
        self.device = next(target.parameters()).device
        cfg = drafter.config if drafter is not None else None
        self.block_size = int(cfg.block_size) if cfg is not None else 0
        self.layer_ids = [int(i) for i in cfg.target_layer_ids] if cfg is not None else []
        self.mask_id = int(getattr(cfg, "mask_token_id", 0) or 0)
        self.temps_G = confidence_temperatures(cfg, device=self.device) if cfg else None

    # -- rows entering the batch ---------------------------------------------------------------
    def _budget_left(self, req: _Request) -> bool:
        return len(req.new_tokens) < self.max_new_tokens + (not self.exact)

    def _new_caches(self) -> PaddedCaches:
        draft = self.drafter.new_cache() if self.drafter is not None else None
        return PaddedCaches(new_target_cache(self.target), draft)

    def _prefill(self, req: _Request):
        """Target forward over the prompt alone; returns the row's caches (and Eagle3's last
        hidden), or None when the first token already ends the request."""
        t0 = time.perf_counter()
        prompt = req.prompt_1P.to(self.device)
        length = prompt.shape[1]
        caches = self._new_caches()
        caches.pad = torch.zeros(1, dtype=torch.long, device=self.device)
        # NOTE: logits of the last position only: [P, V] fp32 logits of a long prompt are GBs.
        logits, feats = target_forward(self.target, caches, prompt, self.layer_ids, 1)
        req.stats.target_forwards += 1
        req.new_tokens.append(verify.sample_token(logits[0, -1], self.temperature, self.generator))
        caches.trim(torch.full((1,), length, device=self.device), length)
        last = None
        if self.drafter is not None:
            positions = torch.arange(length, device=self.device).unsqueeze(0)
            if self.eagle3:
                first = torch.tensor([req.new_tokens], device=self.device, dtype=prompt.dtype)
                next_ids = torch.cat([prompt[:, 1:], first], dim=1)
                hidden = self.drafter.extend(
                    self.drafter.project_context(feats), next_ids, caches.draft_cache,
                    positions=positions,
                )  # fmt: skip
                last = hidden[:, -1]
            else:
                self.drafter.extend_context(feats, positions, caches.draft_cache)
        _sync(self.device)
        req.stats.prefill_time_s += time.perf_counter() - t0
        if req.new_tokens[-1] in self.stops or not self._budget_left(req):
            return None
        return caches, last

    # -- one round -------------------------------------------------------------------------------
    def _draft(self, active: list[_Request], caches: PaddedCaches, last_RH):
        """Drafts [R, G], their logits [R, G, V] and proposal lengths m_r (before the budget)."""
        rows = len(active)
        self.conf_logits = None
        x_start = torch.tensor([r.new_tokens[-1] for r in active], device=self.device)
        if self.drafter is None:
            return x_start, None, None, [0] * rows
        G = self.block_size
        starts = caches.starts()
        key_mask = caches.key_mask()
        if self.eagle3:
            tokens, logits = [], []
            last = last_RH.unsqueeze(1)
            cache = caches.draft_cache
            length = cache.seq_length
            for i in range(G):
                step_logits = self.drafter.compute_logits(last)
                token = verify_sample(step_logits, self.temperature, self.generator)
                tokens.append(token)
                logits.append(step_logits)
                if i + 1 == G or (self.stops and all(int(t) in self.stops for t in token[:, 0])):
                    break
                chain_mask = torch.cat([key_mask, key_mask.new_ones(rows, i + 1)], dim=1)
                last = self.drafter.extend(
                    last, token, cache, positions=(starts + i).unsqueeze(1), key_mask=chain_mask
                )
            cache.crop(length)  # only verified context stays
            drafts, draft_logits = torch.cat(tokens, dim=1), torch.cat(logits, dim=1)
            lengths = []
            for row in drafts.tolist():
                stop = _first_stop(row, self.stops)
                lengths.append(len(row) if stop is None else stop + 1)
            return x_start, drafts, draft_logits, lengths
        block = torch.full((rows, G), self.mask_id, dtype=torch.long, device=self.device)
        block[:, 0] = x_start
        positions = starts.unsqueeze(1) + torch.arange(G, device=self.device)
        hidden = self.drafter.draft_block_from_cache(block, positions, caches.draft_cache, key_mask)
        drafts, draft_logits = self.drafter.sample_draft_tokens(
            self.drafter.compute_logits(hidden), first_prev_token_ids=block[:, 0],
            hidden_states=hidden, temperature=self.temperature, generator=self.generator,
        )  # fmt: skip
        lengths = [G] * rows
        self.conf_logits = None
        if self.drafter.confidence_head is not None:  # recorded for calibration
            prev = torch.cat([block[:, :1], drafts[:, :-1]], dim=1)
            self.conf_logits = self.drafter.predict_confidence(hidden, prev)
        if self.policy != "full":
            logits_RG = self.conf_logits
            if self.temps_G is not None:
                logits_RG = logits_RG / self.temps_G.to(logits_RG.dtype)
            conf = torch.sigmoid(logits_RG).tolist()
            if self.policy == "threshold":
                lengths = [
                    next((j for j, c in enumerate(row) if c < self.threshold), G) for row in conf
                ]
            else:
                lengths = schedule_prefixes(conf, self.sps)
        return x_start, drafts, draft_logits, lengths

    def _verify(self, drafts_RM, num_RM, logits_RM1V, draft_logits_RMV):
        """(accepted [R], next token [R]) lists, each row judged on its first m_r drafts."""
        if self.temperature == 0.0:
            return verify.verify_greedy_batch(drafts_RM, num_RM, logits_RM1V)
        return verify.verify_sampled_batch(
            drafts_RM,
            num_RM,
            verify.logits_to_probs(draft_logits_RMV, self.temperature)
            if draft_logits_RMV is not None
            else None,
            verify.logits_to_probs(logits_RM1V, self.temperature),
            self.generator,
        )

    def run(self, prompts: list[torch.Tensor]) -> list[BatchedResult]:
        """Decode every prompt [1, P]; results in prompt order."""
        queue = [
            _Request(i, p, DecodeStats(prompt_tokens=int(p.shape[1])))
            for i, p in enumerate(prompts)
        ]
        queue.reverse()
        done: list[_Request] = []
        active: list[_Request] = []
        caches = self._new_caches()
        last_RH = None  # Eagle3: each row's last verified hidden state [R, H]
        with torch.inference_mode():
            while active or queue:
                while queue and len(active) < self.batch_size:
                    req = queue.pop()
                    entered = self._prefill(req)
                    if entered is None:
                        done.append(req)
                        continue
                    caches.add(entered[0])
                    active.append(req)
                    if self.eagle3:
                        last_RH = (
                            entered[1] if last_RH is None else torch.cat([last_RH, entered[1]])
                        )
                if not active:
                    continue
                last_RH = self._round(active, caches, last_RH)
                keep = [i for i, r in enumerate(active) if self._still_running(r)]
                if len(keep) < len(active):
                    done += [r for i, r in enumerate(active) if i not in keep]
                    active = [active[i] for i in keep]
                    caches.select(keep)
                    if last_RH is not None:
                        last_RH = last_RH[keep]
                        if not keep:
                            last_RH = None
        out = []
        for req in sorted(done, key=lambda r: r.index):
            tokens = req.new_tokens
            stop = _first_stop(tokens, self.stops)
            if stop is not None:
                tokens = tokens[: stop + 1]
            tokens = tokens[: self.max_new_tokens]
            req.stats.new_tokens = len(tokens)
            tail = torch.tensor([tokens], dtype=req.prompt_1P.dtype)
            out.append(
                BatchedResult(req.index, torch.cat([req.prompt_1P.cpu(), tail], 1), req.stats)
            )
        return out

    def _still_running(self, req: _Request) -> bool:
        return req.new_tokens[-1] not in self.stops and self._budget_left(req)

    def _round(self, active: list[_Request], caches: PaddedCaches, last_RH):
        rows = len(active)
        t0 = time.perf_counter()
        x_start, drafts, draft_logits, lengths = self._draft(active, caches, last_RH)
        for i, req in enumerate(active):
            if self.exact:  # the round commits at most m_r + 1 tokens: never verify past the budget
                lengths[i] = min(lengths[i], self.max_new_tokens - len(req.new_tokens) - 1)
            lengths[i] = max(lengths[i], 0)
        M = max(lengths)
        verify_ids = x_start.unsqueeze(1)
        if M > 0:
            verify_ids = torch.cat([verify_ids, drafts[:, :M]], dim=1)
        _sync(self.device)
        t1 = time.perf_counter()
        starts = caches.starts()
        logits, feats = target_forward(self.target, caches, verify_ids, self.layer_ids)
        num_R = torch.tensor(lengths, device=self.device)
        accepted, next_tokens = self._verify(
            verify_ids[:, 1:], num_R, logits, draft_logits[:, :M] if M > 0 else None
        )
        drafted = verify_ids[:, 1:].tolist()
        conf = self.conf_logits.tolist() if self.conf_logits is not None else [[]] * rows
        keep = []
        for i, req in enumerate(active):
            num_proposed, num_accepted = lengths[i], accepted[i]
            committed = drafted[i][:num_accepted] + [next_tokens[i]]
            stop = _first_stop(committed, self.stops)
            if stop is not None and stop < num_accepted:
                # an accepted draft is a stop token: the slots after it were never really proposed
                num_proposed = num_accepted = stop + 1
                committed = committed[: stop + 1]
            req.new_tokens.extend(committed)
            s = req.stats
            s.target_forwards += 1
            s.proposed_per_round.append(num_proposed)
            s.accepted_per_round.append(num_accepted)
            s.committed_per_round.append(len(committed))
            s.confidence_logits_per_round.append(conf[i][:num_proposed])
            keep.append(min(num_accepted, M) + 1)
        keep_R = torch.tensor(keep, device=self.device)
        appended = M + 1
        new_last = None
        if self.drafter is not None:
            positions = starts.unsqueeze(1) + torch.arange(appended, device=self.device)
            if self.eagle3:
                # position i of the context pairs its features with the token that follows it
                next_ids = torch.cat([verify_ids[:, 1:], verify_ids[:, :1]], dim=1).clone()
                next_ids[torch.arange(rows, device=self.device), keep_R - 1] = torch.tensor(
                    next_tokens, device=self.device, dtype=next_ids.dtype
                )
                key_mask = torch.cat(
                    [caches.key_mask(), caches.key_mask().new_ones(rows, appended)], dim=1
                )
                hidden = self.drafter.extend(
                    self.drafter.project_context(feats), next_ids, caches.draft_cache,
                    positions=positions, key_mask=key_mask,
                )  # fmt: skip
                new_last = hidden[torch.arange(rows, device=self.device), keep_R - 1]
            else:
                self.drafter.extend_context(feats, positions, caches.draft_cache)
        caches.trim(keep_R, appended)
        _sync(self.device)
        t2 = time.perf_counter()
        for req in active:  # the batch's time, shared out among its rows
            req.stats.draft_time_s += (t1 - t0) / rows
            req.stats.verify_time_s += (t2 - t1) / rows
        return new_last


def verify_sample(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """[R, 1, V] -> [R, 1] drafted tokens (argmax at T = 0)."""
    from dspark_ds.drafters.common.sampling import sample_from_logits

    return sample_from_logits(logits, temperature, generator)


def batched_generate(target, drafter, prompts: list[torch.Tensor], **kwargs) -> list[BatchedResult]:
    """`BatchedDecoder(target, drafter, **kwargs).run(prompts)`."""
    return BatchedDecoder(target, drafter, **kwargs).run(prompts)


# ---- `dspark-ds eval --batch_size N` -------------------------------------------------------------


@dataclass
class PromptRun:
    """One prompt under one decoding mode: its counters (with its share of the batch's time)."""

    stats: DecodeStats

    @property
    def time_s(self) -> float:
        s = self.stats
        return s.prefill_time_s + s.draft_time_s + s.verify_time_s


def decode_prompts(
    cfg, target, drafter, prompts: list[torch.Tensor], seed: int, stops: list[int], sps: SPS | None
) -> tuple[list[DecodeStats], list[PromptRun], dict[str, list[PromptRun]]]:
    """A benchmark's prompts under `cfg` (an EvalConfig) at `cfg.batch_size`: the drafter with
    the configured policy, the target alone, and (with `cfg.scheduler.compare`) full-γ,
    static-threshold and scheduler runs. Each mode gets its own generator seeded with `seed`."""
    device = next(target.parameters()).device

    def run(model, policy: str, threshold: float = 0.0) -> list[BatchedResult]:
        return batched_generate(
            target, model, prompts, batch_size=cfg.batch_size,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, policy=policy,
            confidence_threshold=threshold, sps=sps,
            generator=torch.Generator(device=device).manual_seed(seed), stop_token_ids=stops,
            budget_accounting=cfg.budget_accounting,
        )  # fmt: skip

    if cfg.scheduler.enabled:
        policy, threshold = "scheduler", 0.0
    elif cfg.confidence_threshold > 0.0:
        policy, threshold = "threshold", cfg.confidence_threshold
    else:
        policy, threshold = "full", 0.0
    main = [r.stats for r in run(drafter, policy, threshold)]
    baseline = [PromptRun(r.stats) for r in run(None, "full")]
    policies: dict[str, list[PromptRun]] = {}
    if cfg.scheduler.compare:
        policies["full"] = [PromptRun(r.stats) for r in run(drafter, "full")]
        policies["threshold"] = [
            PromptRun(r.stats) for r in run(drafter, "threshold", cfg.scheduler.compare_threshold)
        ]
        policies["scheduler"] = [PromptRun(r.stats) for r in run(drafter, "scheduler")]
    return main, baseline, policies


def policy_summary(runs: list[PromptRun], baseline_tokens_per_s: float | None) -> dict:
    """Throughput of one policy over a benchmark's prompts, and its speedup over the target."""
    tokens = sum(r.stats.new_tokens for r in runs)
    seconds = sum(r.time_s for r in runs)
    rounds = sum(r.stats.rounds for r in runs)
    tokens_per_s = tokens / seconds if seconds > 0 else float("nan")
    return {
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s else None,
        "tau": sum(sum(r.stats.committed_per_round) for r in runs) / rounds if rounds else None,
        "drafts_verified_per_round": (
            sum(sum(r.stats.proposed_per_round) for r in runs) / rounds if rounds else None
        ),
    }
