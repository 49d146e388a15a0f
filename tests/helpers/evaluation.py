"""Tiny targets and random drafters for the eval tests (token ids only, no tokenizer), and
`dspark-ds eval` run in this process on the CPU."""

from __future__ import annotations

import contextlib
import itertools

import torch
from transformers import Qwen3ForCausalLM

from dspark_ds.drafters import build_draft_config, build_draft_model
from dspark_ds.drafters.registry import kind_of
from dspark_ds.eval.batched import batched_generate
from dspark_ds.eval.decoding import speculative_generate
from dspark_ds.eval.target_step import TargetDecoder

from helpers.gemma4 import greedy_without_cache
from helpers.tiny_models import qwen3_target_config


def tiny_target(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 3,
    seed: int = 0,
    logit_scale: float = 1.0,
    **overrides,
) -> Qwen3ForCausalLM:
    """A random fp32 Qwen3 causal LM; `logit_scale` sharpens its next-token distributions."""
    torch.manual_seed(seed)
    cfg = qwen3_target_config(
        vocab_size, hidden_size=hidden_size, num_layers=num_layers, **overrides
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def random_drafter(
    target,
    *,
    layer_ids=(0, 1),
    block_size: int = 4,
    markov_rank: int = 8,
    markov_head_type: str = "vanilla",
    confidence: bool = True,
    seed: int = 1,
    markov_std: float | None = None,
    num_draft_layers: int = 1,
    backbone: str = "auto",
):
    """A randomly initialised drafter for `target` (embedding and lm_head copied from it);
    `backbone` is the `model.backbone` field."""
    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    cfg = build_draft_config(
        target.config,
        target_layer_ids=list(layer_ids),
        mask_token_id=vocab - 1,
        num_draft_layers=num_draft_layers,
        block_size=block_size,
        backbone=backbone,
        num_anchors=8,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        confidence_head_alpha=1.0 if confidence else 0.0,
        confidence_head_with_markov=confidence and markov_rank > 0,
    )
    drafter = build_draft_model(cfg).eval()
    drafter.initialize_embeddings_and_head(target.model.embed_tokens.weight, target.lm_head.weight)
    if markov_std is not None:
        with torch.no_grad():
            for p in drafter.markov_head.parameters():
                p.normal_(0.0, markov_std)
    return drafter


@torch.no_grad()
def exact_continuation_probs(target, prompt_1P: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """P(x_1..x_K | prompt) under `target` at T = 1 for every continuation: [V] * K."""
    vocab = target.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=num_tokens)))
    full = torch.cat([prompt_1P.expand(len(seqs), -1), seqs], dim=1)
    logp = torch.log_softmax(target(full).logits.float(), dim=-1)
    start = prompt_1P.shape[1] - 1
    rows = torch.arange(len(seqs))
    total = sum(logp[rows, start + k, seqs[:, k]] for k in range(num_tokens))
    return total.exp().view([vocab] * num_tokens)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Goodness of fit of `counts` to `probs`; cells expecting < min_expected are pooled."""
    n = counts.sum().double()
    expected = probs.flatten().double() * n
    observed = counts.flatten().double()
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    assert dof >= 3, f"too few cells for a chi-square test (dof={dof})"
    # The chi-square survival function: the regularised upper incomplete gamma Q(k/2, x/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def sps_cliff(rows, length):
    """A speed-per-step table for the scheduler: cheap up to 3 tokens per row, then steep, so
    that it cuts many proposals."""
    return 1.0 if length <= 2 else 0.4 / length


# every policy of batched decoding: full gamma, a confidence threshold, the scheduler (its
# speed-per-step curve a cliff after 2 tokens, so that it cuts drafts short)
BATCHED_POLICIES = (
    dict(policy="full"),
    dict(policy="threshold", confidence_threshold=0.4),
    dict(policy="scheduler", sps=sps_cliff),
)


def decoding_prompts(vocab: int) -> list[torch.Tensor]:
    """Three prompts of 3, 9 and 6 tokens below `vocab` - 1, the same in every run."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab - 1, (1, n), generator=g) for n in (3, 9, 6)]


def greedy_reference(target, prompt, max_new_tokens: int, with_generate: bool = True):
    """The target's greedy continuation by full forwards (no cache to get wrong), checked
    against its own `generate` unless `with_generate` is False."""
    want = greedy_without_cache(target, prompt, max_new_tokens, set())
    if with_generate:
        generated = target.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=max_new_tokens,
            attention_mask=torch.ones_like(prompt),
        )
        assert generated.tolist() == want.tolist()
    return want


def check_greedy_rounds(
    target, drafter, prompts, want, max_new_tokens: int, policies=BATCHED_POLICIES
) -> tuple[int, int]:
    """Greedy speculative decoding of `prompts`, one row at a time (full gamma, a 0.4 confidence
    threshold) and two rows at a time with prompts entering and leaving under each of
    `policies`: every output is asserted equal to `want` (the target's greedy continuation of
    the same prompt). The drafts proposed and accepted, summed."""
    proposed = accepted = 0
    for threshold in (0.0, 0.4):
        for prompt, expected in zip(prompts, want):
            got, stats = speculative_generate(
                target,
                drafter,
                prompt,
                max_new_tokens=max_new_tokens,
                confidence_threshold=threshold,
            )
            assert got.tolist() == expected.tolist(), threshold
            proposed += sum(stats.proposed_per_round)
            accepted += sum(stats.accepted_per_round)
    for kwargs in policies:
        results = batched_generate(
            target, drafter, prompts, batch_size=2, max_new_tokens=max_new_tokens, **kwargs
        )
        for r in results:
            assert r.output_ids.tolist() == want[r.index].tolist(), kwargs
            proposed += sum(r.stats.proposed_per_round)
            accepted += sum(r.stats.accepted_per_round)
    return proposed, accepted


def sampled_continuations(
    target, drafter, prompt, samples: int, num_new: int = 3, batch_size: int | None = None
) -> tuple[torch.Tensor, int]:
    """T = 1 speculative decoding of `prompt` `samples` times (batched, `batch_size` rows at a
    time, or one row at a time when None): the count of each `num_new`-token continuation
    ([V] * num_new) and the drafts accepted."""
    counts = torch.zeros([target.config.vocab_size] * num_new)
    generator = torch.Generator().manual_seed(0)
    start, accepted = prompt.shape[1], 0
    if batch_size is None:
        runs = (
            speculative_generate(
                target,
                drafter,
                prompt,
                max_new_tokens=num_new,
                temperature=1.0,
                generator=generator,
            )
            for _ in range(samples)
        )
    else:
        results = batched_generate(
            target,
            drafter,
            [prompt] * samples,
            batch_size=batch_size,
            max_new_tokens=num_new,
            temperature=1.0,
            generator=generator,
        )
        runs = ((r.output_ids, r.stats) for r in results)
    for out, stats in runs:
        counts[tuple(out[0, start:].tolist())] += 1
        accepted += sum(stats.accepted_per_round)
    return counts, accepted


def continuation_pvalues(counts: torch.Tensor, exact: torch.Tensor) -> list[float]:
    """Chi-square p-values of sampled 3-token continuations against their exact distribution:
    the first token's, and the last two's jointly."""
    return [
        chi_square_pvalue(counts.sum(dim=(1, 2)), exact.sum(dim=(1, 2))),
        chi_square_pvalue(counts.sum(dim=0), exact.sum(dim=0)),
    ]


def decoding_pairs(build, families, vocab: int) -> dict[str, tuple]:
    """Each family's tiny target (`build(family, vocab)`) and a random drafter on its layers 0
    and 2: what the lossless-decoding tests run."""
    out = {}
    for family in families:
        target = build(family, vocab)
        out[family] = (target, random_drafter(target, layer_ids=(0, 2), markov_std=0.5))
    return out


def check_sampled_distribution(
    target, prompt, samples: int, min_accepted: float, batch_size: int | None = None
) -> None:
    """T = 1 speculative decoding of `prompt`, `samples` times, by a random drafter (one tapped
    layer, γ 3, Markov rank 4) gives the target's own distribution of 3-token continuations
    (chi-square p-values over 1e-3), with more than `min_accepted` drafts kept (rows cut back
    to different lengths)."""
    drafter = random_drafter(target, layer_ids=(0,), block_size=3, markov_rank=4, markov_std=1.0)
    exact = exact_continuation_probs(target, prompt, 3)
    counts, accepted = sampled_continuations(target, drafter, prompt, samples, 3, batch_size)
    assert accepted > min_accepted, accepted
    pvalues = continuation_pvalues(counts, exact)
    assert min(pvalues) > 1e-3, pvalues


def rolled_back_and_clean(
    target, ids: torch.Tensor, start: int, kept: int, junk: list[int]
) -> tuple[TargetDecoder, TargetDecoder]:
    """A decoder that saw ids[:, :start], then verified ids[:, start:kept] followed by `junk`
    (drafts the round rejects) and kept the real tokens; and one that only saw ids[:, :kept]."""
    rolled = TargetDecoder(target, [])
    rolled.forward(ids[:, :start])
    rolled.keep(start)
    rolled.forward(torch.cat([ids[:, start:kept], torch.tensor([junk])], dim=1))
    rolled.keep(kept)
    clean = TargetDecoder(target, [])
    clean.forward(ids[:, :kept])
    clean.keep(kept)
    return rolled, clean


def record_proposals(monkeypatch, drafter) -> list[list[int]]:
    """The drafts of every batch-1 round (row 0), as the kind's `decode.propose` returns them, in
    the list returned (cleared by the caller between generations)."""
    seen: list[list[int]] = []
    decode = kind_of(drafter).decode
    propose = decode.propose

    def recording(model, draft_round):
        proposal = propose(model, draft_round)
        seen.append(proposal.tokens[0].tolist())
        return proposal

    monkeypatch.setattr(decode, "propose", recording)
    return seen


@contextlib.contextmanager
def counting_forwards(model):
    """Counts the calls of `model` inside the block: `with counting_forwards(t) as n: ...`,
    then `n[0]`."""
    count = [0]
    handle = model.register_forward_pre_hook(
        lambda module, args: count.__setitem__(0, count[0] + 1)
    )
    try:
        yield count
    finally:
        handle.remove()


def cpu_eval(target_path, drafter, output_dir, **fields) -> dict:
    """`dspark-ds eval` in this process, greedy, fp32 on the CPU, tracking off: its payload.
    `fields`: the rest of `EvalConfig` (benchmarks, sizes)."""
    # lazy: a test may have put a copy of the package in its place (test_registry's toy kind)
    from dspark_ds.eval import EvalConfig, run_eval
    from dspark_ds.target import TargetPathConfig

    cfg = EvalConfig(
        target=TargetPathConfig(path=str(target_path)),
        drafter=str(drafter),
        output_dir=str(output_dir),
        temperature=0.0,
        dtype="float32",
        device="cpu",
        **fields,
    )
    cfg.tracking.enabled = False
    return run_eval(cfg)
