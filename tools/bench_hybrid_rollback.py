"""What the exact rollback of a hybrid target's recurrent layers costs per verification round.

A random Qwen3.5-shaped text model (transformers' own `Qwen3_5ForCausalLM`, layers 3 Gated
DeltaNet : 1 full attention) on this machine; R rows in flight, each with `--context` cached
tokens, verify `gamma + 1` tokens per row (eval/padded.py, the batched decoder's caches), then
keep:

- all of them (nothing to roll back: the snapshot is the only cost),
- 1 per row (every draft rejected: one replay group),
- 1..R per row (R distinct lengths: R replay groups).

Printed per case: the verification forward without the rollback machinery, with it (the
snapshot and the recorded mixer inputs), the rollback itself (restore + replay of the mixers),
and, for comparison, a whole-target forward over the kept tokens (what replaying the full
model would cost). The fastest of `--repeats` after one warm-up (the least disturbed by other
load on a shared machine).

    python3 tools/bench_hybrid_rollback.py --hidden 1024 --layers 8 --rows 1 4
"""

from __future__ import annotations

import argparse
import time

import torch


def _model(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = args.hidden // 128
    cfg = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4),
        linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()


def _best(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times) * 1000


@torch.inference_mode()
def bench(target, rows: int, args) -> list[dict]:
    from dspark_ds.eval.padded import PaddedCaches, target_forward
    from dspark_ds.eval.recurrent import RecurrentState
    from dspark_ds.eval.target_step import new_target_cache

    states = RecurrentState.for_target(target)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    verify_len = args.gamma + 1

    def fresh(with_states: bool) -> PaddedCaches:
        caches = PaddedCaches(new_target_cache(target), None, states if with_states else None)
        caches.pad = torch.zeros(rows, dtype=torch.long)
        ctx = torch.randint(0, vocab, (rows, args.context), generator=g)
        target_forward(target, caches, ctx, [], logits_to_keep=1)
        caches.trim(torch.full((rows,), args.context), args.context)
        return caches

    ids = torch.randint(0, vocab, (rows, verify_len), generator=g)
    out = []
    keeps = {
        "keep all": [verify_len] * rows,
        "keep 1": [1] * rows,
        f"keep 1..{rows}": [1 + r % verify_len for r in range(rows)],
    }
    for name, keep in keeps.items():
        keep_R = torch.tensor(keep)
        plain, recorded = fresh(False), fresh(True)

        def verify_plain(plain=plain):  # every column kept: the caches grow a round each
            target_forward(target, plain, ids, [])
            plain.trim(torch.full((rows,), verify_len), verify_len)

        forward_plain = _best(verify_plain, args.repeats)
        # the recorded forward and the rollback, timed apart on the same rounds
        fwd, rollback = [], []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            target_forward(target, recorded, ids, [])
            t1 = time.perf_counter()
            recorded.trim(keep_R, verify_len)
            t2 = time.perf_counter()
            if i:
                fwd.append(t1 - t0)
                rollback.append(t2 - t1)
        # a whole-target replay: one forward per distinct kept length below verify_len
        replay = fresh(False)
        lengths = sorted({k for k in keep if k < verify_len})

        def full_replay(replay=replay, lengths=lengths):
            for k in lengths:
                target_forward(target, replay, ids[:, :k], [])
                replay.trim(torch.full((rows,), k), k)

        full = _best(full_replay, args.repeats) if lengths else 0.0
        out.append({
            "rows": rows, "case": name,
            "verify_ms": forward_plain,
            "verify_recorded_ms": min(fwd) * 1000,
            "rollback_ms": min(rollback) * 1000,
            "full_replay_ms": full,
        })  # fmt: skip
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="a multiple of 4 (3 linear : 1 full)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    target = _model(args)
    params = sum(p.numel() for p in target.parameters()) / 1e6
    print(f"qwen3_5_text hidden {args.hidden}, {args.layers} layers, {params:.0f}M params, "
          f"{args.dtype}, context {args.context}, verify {args.gamma + 1} tokens/row, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'rows':>4} {'case':<10} {'verify':>8} {'+record':>8} {'rollback':>9} "
          f"{'overhead':>8} {'full replay':>11}")  # fmt: skip
    for rows in args.rows:
        for r in bench(target, rows, args):
            overhead = (r["verify_recorded_ms"] + r["rollback_ms"]) / r["verify_ms"] - 1
            print(f"{r['rows']:>4} {r['case']:<10} {r['verify_ms']:>6.1f}ms "
                  f"{r['verify_recorded_ms']:>6.1f}ms {r['rollback_ms']:>7.1f}ms "
                  f"{overhead:>+7.0%} {r['full_replay_ms']:>9.1f}ms")  # fmt: skip


if __name__ == "__main__":
    main()
