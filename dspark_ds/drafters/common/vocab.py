"""A reduced draft vocabulary (`model.draft_vocab_size`, docs/drafters.md#a-reduced-draft-vocabulary).

The drafter predicts over N of the target's V tokens. Its `lm_head` then has N rows (the
target's rows of those tokens, frozen), and two buffers say which tokens they are, in the
convention of EAGLE-3, speculators and vLLM:

    d2t  int64 [N]: draft id i is target id i + d2t[i] (an offset; ids ascending)
    t2d  bool  [V]: target id t is in the draft vocabulary

With N = 0 (the default) the drafter predicts over the whole vocabulary through the target's
own head and has neither buffer.

Training reads logits over N (the draft's and the target's, both through the same rows: the
target's distribution restricted to the draft vocabulary and renormalised, as speculators
defines it) and labels mapped to draft ids (`draft_labels`). Decoding scatters the N logits
into V with -inf elsewhere (`full_vocab_logits`, what vLLM's `compute_logits` does): a token
outside the vocabulary has probability 0 under the draft, is never proposed, and the
verification, which reads the target's own logits, stays exact.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_ds.errors import ConfigError

VOCAB_MAPS = ("d2t", "t2d")
"""The buffers of a reduced draft vocabulary, named as EAGLE-3, speculators and vLLM name them."""


def draft_vocab_size(config) -> int:
    """N of a drafter's transformers config; 0 = the whole vocabulary."""
    n = int(getattr(config, "draft_vocab_size", 0) or 0)
    return 0 if n == int(config.vocab_size) else n


def check_draft_vocab_size(n: int | None, vocab_size: int, name: str = "draft_vocab_size") -> int:
    """N checked against the target's vocabulary (ConfigError names `name`); 0 for None."""
    n = int(n or 0)
    if n < 0 or n > vocab_size:
        raise ConfigError(
            f"{name}: must be in [0, {vocab_size}] (0 = the whole vocabulary), got {n}"
        )
    return 0 if n == vocab_size else n


def vocab_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a set of target ids (any order, no repeats)."""
    ids = torch.as_tensor(target_ids, dtype=torch.int64).flatten().sort().values
    if ids.numel() and (ids[0] < 0 or ids[-1] >= vocab_size or (ids[1:] == ids[:-1]).any()):
        raise ConfigError(f"d2t: draft ids must be distinct target ids in [0, {vocab_size})")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel(), dtype=torch.int64), t2d


def top_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` most frequent token ids of `counts` [V] (ties: the lower id first; tokens never
    seen fill the rest in id order, as speculators does), ascending."""
    order = torch.sort(-counts.to(torch.int64), stable=True).indices  # ties: id order
    return order[:n].sort().values


class DraftVocab:
    """Mixed into a drafter (DSpark, Eagle3): the buffers and the maps between the two id spaces.

    The class using it has `config` and calls `init_draft_vocab()` in its `__init__` before it
    builds its `lm_head` (`head_rows()` rows)."""

    config: object
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None

    def init_draft_vocab(self) -> None:
        vocab = int(self.config.vocab_size)
        n = draft_vocab_size(self.config)
        self.draft_vocab = n
        # NOTE: placeholders (draft id i = target id i) until `set_draft_vocab`; persistent, so
        # they travel in state dicts, checkpoints and exports as `d2t` / `t2d`
        d2t = t2d = None
        if n:
            d2t = torch.zeros(n, dtype=torch.int64)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[:n] = True
        nn.Module.register_buffer(self, "d2t", d2t)
        nn.Module.register_buffer(self, "t2d", t2d)

    def head_rows(self) -> int:
        return self.draft_vocab or int(self.config.vocab_size)

    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Installs the maps (before the head is copied from the target's rows)."""
        if not self.draft_vocab:
            raise ConfigError(
                "d2t: this drafter predicts the whole vocabulary (draft_vocab_size 0)"
            )
        ids = d2t.to(torch.int64).cpu() + torch.arange(d2t.numel())
        want_d2t, want_t2d = vocab_maps(ids, int(self.config.vocab_size))
        if want_d2t.numel() != self.draft_vocab:
            raise ConfigError(
                f"d2t: {want_d2t.numel()} entries, draft_vocab_size is {self.draft_vocab}"
            )
        if t2d is not None and not torch.equal(t2d.bool().cpu(), want_t2d):
            raise ConfigError("t2d: does not mark the target ids that d2t maps to")
        self.d2t.copy_(want_d2t.to(self.d2t.device))
        self.t2d.copy_(want_t2d.to(self.t2d.device))

    def draft_target_ids(self) -> torch.Tensor:
        """int64 [N]: the target id of every draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def head_weight_rows(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The target's lm_head [V, H] -> the drafter's head [N, H] (the whole one without a
        draft vocabulary)."""
        if not self.draft_vocab:
            return lm_head_weight
        return lm_head_weight[self.draft_target_ids().to(lm_head_weight.device)]

    def draft_labels(self, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target ids -> (draft ids, in-vocabulary mask); a label outside the draft vocabulary
        gets draft id 0 and False. (target_ids, None) without a draft vocabulary."""
        if not self.draft_vocab:
            return target_ids, None
        inside = self.t2d[target_ids]
        # draft id of t = number of draft tokens below t
        below = torch.cumsum(self.t2d.to(torch.int64), 0) - self.t2d.to(torch.int64)
        return torch.where(inside, below[target_ids], 0), inside

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (identity without a draft vocabulary)."""
        if not self.draft_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., N] draft logits -> [..., V], -inf outside the draft vocabulary (decoding)."""
        if not self.draft_vocab:
            return logits
        out = logits.new_full((*logits.shape[:-1], int(self.config.vocab_size)), float("-inf"))
        out[..., self.draft_target_ids()] = logits
        return out
