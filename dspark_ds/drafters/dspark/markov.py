"""Markov heads (docs/algorithm.md#markov-heads): a low-rank bias on slot k's logits from the previous token.

`apply_block_logits` is the teacher-forced training path over whole blocks;
`sample_block` runs left to right at inference, feeding each sampled token to the next slot.
Both share `_step`, so teacher forcing with the labels equals sampling forced to the labels.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_ds.drafters.common.sampling import sample_from_logits
from dspark_ds.errors import ConfigError

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class VanillaMarkov(nn.Module):
    """bias_k = W2 W1[x_{k-1}] (paper Eq. 5)."""

    def __init__(
        self, vocab_size: int, markov_rank: int, hidden_size: int, out_size: int | None = None
    ):
        super().__init__()
        self.markov_rank = markov_rank
        # W1 reads the previous token (a target id); W2 writes the head's logits (the draft
        # vocabulary's `out_size`, as speculators' Markov head)
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, out_size or vocab_size, bias=False)

    def prev_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids.long())

    def init_state(self, like: torch.Tensor) -> torch.Tensor | None:
        return None

    def _step(self, state, token_ids, hidden):
        """One slot: returns (new_state, bias [..., V])."""
        return state, self.markov_w2(self.prev_embeddings(token_ids))

    def apply_block_logits(self, base_logits, *, token_ids, hidden_states):
        """base_logits [..., G, V], token_ids [..., G] (previous tokens), hidden [..., G, H]."""
        state = self.init_state(hidden_states[..., 0, :])
        out = []
        for k in range(base_logits.shape[-2]):
            state, bias = self._step(state, token_ids[..., k], hidden_states[..., k, :])
            out.append(base_logits[..., k, :] + bias.to(base_logits.dtype))
        return torch.stack(out, dim=-2)

    def sample_block(
        self,
        base_logits,
        *,
        first_prev_token_ids,
        hidden_states,
        temperature,
        generator=None,
        forced_tokens=None,
        to_target=None,
    ):
        """base_logits [B, G, V] -> (tokens [B, G], corrected logits [B, G, V]).

        `forced_tokens [B, G]` replaces each draw by the given token (scoring a known draft).
        `to_target`: maps a drawn index to its target id (a reduced draft vocabulary: the
        logits are over it, the tokens and the next slot's input are target ids).
        """
        state = self.init_state(hidden_states[:, 0, :])
        prev = first_prev_token_ids.long()
        tokens, logits = [], []
        for k in range(base_logits.shape[1]):
            state, bias = self._step(state, prev, hidden_states[:, k, :])
            step_logits = base_logits[:, k, :] + bias.to(base_logits.dtype)
            if forced_tokens is None:
                prev = sample_from_logits(step_logits, temperature, generator)
                if to_target is not None:
                    prev = to_target(prev)
            else:
                prev = forced_tokens[:, k].long()
            tokens.append(prev)
            logits.append(step_logits)
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)


class GatedMarkov(VanillaMarkov):
    """bias_k = W2 (g ⊙ e), g = σ(gate_proj([h_k; e])), e = W1[x_{k-1}]."""

    def __init__(self, vocab_size: int, markov_rank: int, hidden_size: int, out_size=None):
        super().__init__(vocab_size, markov_rank, hidden_size, out_size)
        self.gate_proj = nn.Linear(hidden_size + markov_rank, markov_rank)

    def _step(self, state, token_ids, hidden):
        e = self.prev_embeddings(token_ids)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e.to(hidden.dtype)], dim=-1)))
        return state, self.markov_w2(gate.to(e.dtype) * e)


class RNNMarkov(VanillaMarkov):
    """GRU-like state across the block (paper Eq. 6); s_0 = 0.

    [g; c; o] = joint_proj([s_{k-1}; e; h_k]); s_k = σ(g) s_{k-1} + (1-σ(g)) tanh(c);
    bias_k = W2 tanh(o).
    """

    def __init__(self, vocab_size: int, markov_rank: int, hidden_size: int, out_size=None):
        super().__init__(vocab_size, markov_rank, hidden_size, out_size)
        self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)

    def init_state(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(*like.shape[:-1], self.markov_rank)

    def _step(self, state, token_ids, hidden):
        e = self.prev_embeddings(token_ids).to(hidden.dtype)
        gate, cand, out = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return state, self.markov_w2(torch.tanh(out))


def build_markov_head(config, out_size: int | None = None) -> VanillaMarkov | None:
    rank = int(getattr(config, "markov_rank", 0) or 0)
    if rank == 0:
        return None
    kind = str(getattr(config, "markov_head_type", "vanilla")).lower()
    heads = {"vanilla": VanillaMarkov, "gated": GatedMarkov, "rnn": RNNMarkov}
    if kind not in heads:
        raise ConfigError(f"markov_head_type: expected one of {MARKOV_HEAD_TYPES}, got {kind!r}")
    return heads[kind](int(config.vocab_size), rank, int(config.hidden_size), out_size)


class ConfidenceHead(nn.Module):
    """One logit per slot: P(slot k accepted | earlier slots accepted) (paper Eq. 7); `bias`
    False for the layouts whose engines build it without one (DeepSeek-V4's drafter)."""

    def __init__(self, input_dim: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)
