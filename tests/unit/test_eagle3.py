"""Eagle3 baseline: the batched TTT forward against a naive per-position reference, the loss,
train/serve parity with the chain-drafting cache, and the interchange round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3Config

from dspark_ds.drafters import load_draft_model, save_draft_model
from dspark_ds.drafters.eagle3.build import build_eagle3_config
from dspark_ds.drafters.eagle3.loss import compute_eagle3_loss
from dspark_ds.drafters.eagle3.model import build_ttt_eval_mask
from dspark_ds.drafters.eagle3.qwen3 import Qwen3Eagle3Model
from dspark_ds.drafters.io import build_draft_model
from dspark_ds.drafters.registry import kind_of

from helpers.drafters import spread_weights
from helpers.tiny_models import tiny_widths

VOCAB, HIDDEN, LAYER_IDS = 96, 32, [0, 1, 2]


def target_config() -> Qwen3Config:
    return Qwen3Config(
        **tiny_widths(VOCAB, hidden_size=HIDDEN, head_dim=8, max_position_embeddings=128)
    )


def make_model(num_draft_layers: int = 1, ttt_length: int = 4, seed: int = 0) -> Qwen3Eagle3Model:
    cfg = build_eagle3_config(
        target_config(),
        target_layer_ids=LAYER_IDS,
        ttt_length=ttt_length,
        step_loss_decay=0.8,
        num_draft_layers=num_draft_layers,
    )
    torch.manual_seed(seed)
    model = build_draft_model(cfg)
    spread_weights(model)
    return model.eval()


def make_batch(bsz: int = 2, seq: int = 11, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(bsz, seq)
    loss_mask[:, :2] = 0  # a prompt
    loss_mask[0, 6] = 0  # a hole (breaks prefixes)
    if bsz > 1:
        loss_mask[1, seq - 3 :] = 0  # right padding in sample 1
    return {
        "input_ids": torch.randint(0, VOCAB, (bsz, seq), generator=g),
        "loss_mask": loss_mask,
        "target_hidden_states": torch.randn(bsz, seq, len(LAYER_IDS) * HIDDEN, generator=g),
        "target_last_hidden_states": torch.randn(bsz, seq, HIDDEN, generator=g),
    }


# ---- the naive reference: one position, one step, one layer at a time, plain formulas -----------
def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    rot = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
    return x * cos + rot * sin


class NaiveEagle3:
    """Re-derives every number in float64 from the state dict; no cache, no masks, no batching."""

    def __init__(self, model: Qwen3Eagle3Model):
        c = model.config
        self.sd = {k: v.double() for k, v in model.state_dict().items()}
        self.eps, self.theta = c.rms_norm_eps, c.rope_parameters["rope_theta"]
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.layers = c.num_hidden_layers

    def layer(self, li, tok, h, pos, keys, values):
        """One position through layer li; appends its key/value, attends over all of `keys`."""
        w = lambda n: self.sd[f"layers.{li}.{n}"]  # noqa: E731
        x = torch.cat(
            [
                rms(self.sd["embed_tokens.weight"][tok], w("input_layernorm.weight"), self.eps),
                rms(h, w("hidden_norm.weight"), self.eps),
            ]
        )
        q = (w("self_attn.q_proj.weight") @ x).view(self.nh, self.hd)
        k = (w("self_attn.k_proj.weight") @ x).view(self.nkv, self.hd)
        v = (w("self_attn.v_proj.weight") @ x).view(self.nkv, self.hd)
        q = rope(rms(q, w("self_attn.q_norm.weight"), self.eps), pos, self.theta)
        k = rope(rms(k, w("self_attn.k_norm.weight"), self.eps), pos, self.theta)
        keys.append(k)
        values.append(v)
        heads = []
        for head in range(self.nh):
            kv_head = head // (self.nh // self.nkv)
            scores = torch.stack([q[head] @ kk[kv_head] for kk in keys]) / math.sqrt(self.hd)
            p = torch.softmax(scores, 0)
            heads.append(sum(p[i] * values[i][kv_head] for i in range(len(keys))))
        h = h + w("self_attn.o_proj.weight") @ torch.cat(heads)
        y = rms(h, w("post_attention_layernorm.weight"), self.eps)
        gate = torch.nn.functional.silu(w("mlp.gate_proj.weight") @ y)
        return h + w("mlp.down_proj.weight") @ (gate * (w("mlp.up_proj.weight") @ y))

    def logits(self, h):
        return self.sd["lm_head.weight"] @ rms(h, self.sd["norm.weight"], self.eps)

    def sample(self, ids, feats, steps):
        """-> [S, steps, V]: the chain drafted from each position t, teacher-forced tokens."""
        seq = len(ids)
        tok = lambda i: int(ids[i]) if i < seq else 0  # noqa: E731
        ctx_k = [[] for _ in range(self.layers)]
        ctx_v = [[] for _ in range(self.layers)]
        step0 = []
        for i in range(seq):  # step 0: causal over the verified positions
            h = self.sd["fc.weight"] @ feats[i].double()
            for li in range(self.layers):
                h = self.layer(li, tok(i + 1), h, i, ctx_k[li], ctx_v[li])
            step0.append(h)
        out = torch.zeros(seq, steps, self.sd["lm_head.weight"].shape[0], dtype=torch.float64)
        for t in range(seq):
            keys = [list(k[: t + 1]) for k in ctx_k]
            values = [list(v[: t + 1]) for v in ctx_v]
            h = step0[t]
            out[t, 0] = self.logits(h)
            for k in range(1, steps):  # step k: own previous output, next token, position t + k
                for li in range(self.layers):
                    h = self.layer(li, tok(t + k + 1), h, t + k, keys[li], values[li])
                out[t, k] = self.logits(h)
        return out

    def loss(self, batch, logits, decay):
        """Σ_k decay^k mean over valid (t) of CE(softmax(target[t+k+1]), draft[t, k])."""
        ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["target_last_hidden_states"]
        bsz, seq = ids.shape
        target = torch.einsum("vh,bsh->bsv", self.sd["lm_head.weight"], last.double())
        total = 0.0
        for k in range(logits.shape[2]):
            num, den = 0.0, 0
            for b in range(bsz):
                for t in range(seq):
                    need = range(t + 1, t + k + 3)
                    if all(i < seq and mask[b, i] > 0 for i in need):
                        p_t = torch.softmax(target[b, t + k + 1], 0)
                        num += -(p_t * torch.log_softmax(logits[b, t, k], 0)).sum()
                        den += 1
            total += decay**k * num / den
        return float(total)


def naive_acceptance(batch, draft_logits, lm_head) -> tuple[list[float], float]:
    """accept_rate@k (Σ_v min(p_d, p_t), averaged over the valid slots of step k) and τ (1 + the
    expected accepted prefix, averaged over anchors whose first step is valid), by plain loops."""
    mask = batch["loss_mask"]
    bsz, seq, steps = draft_logits.shape[:3]
    target = torch.softmax(batch["target_last_hidden_states"].double() @ lm_head.double().T, -1)
    per_step: list[list[float]] = [[] for _ in range(steps)]
    taus = []
    for b in range(bsz):
        for t in range(seq):
            accept = []
            for k in range(steps):
                if not all(i < seq and mask[b, i] > 0 for i in range(t + 1, t + k + 3)):
                    break
                p_d = torch.softmax(draft_logits[b, t, k].double(), -1)
                accept.append(float(torch.minimum(p_d, target[b, t + k + 1]).sum()))
                per_step[k].append(accept[-1])
            if accept:
                taus.append(1.0 + sum(math.prod(accept[: j + 1]) for j in range(len(accept))))
    return [sum(r) / len(r) for r in per_step], sum(taus) / len(taus)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_batched_ttt_forward_matches_naive_reference(num_layers):
    model = make_model(num_draft_layers=num_layers).double()
    batch = make_batch()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    out = model(**batch)
    naive = NaiveEagle3(model)
    ref = torch.stack(
        [naive.sample(batch["input_ids"][b], batch["target_hidden_states"][b], 4) for b in range(2)]
    )
    assert out.draft_logits.shape == (2, 11, 4, VOCAB)
    # NOTE: transformers' RMSNorm and rotary embedding compute in fp32 even for a float64
    # model, hence ~1e-6 differences; a wrong mask or shift shows up at ~1e-1.
    torch.testing.assert_close(out.draft_logits, ref, rtol=1e-5, atol=1e-5)

    loss, metrics = compute_eagle3_loss(out, step_loss_decay=0.8)
    assert loss.item() == pytest.approx(naive.loss(batch, ref, 0.8), rel=1e-6)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-6)


def test_eval_mask_and_labels():
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.float32)
    em = build_ttt_eval_mask(mask, 3)
    # t=0: anchor x1, labels x2, x3, x4(unsupervised) -> [1, 1, 0]
    assert em[0, 0].tolist() == [True, True, False]
    assert em[0, 1].tolist() == [True, False, False]  # labels x3, x4
    assert em[0, 2].tolist() == [False, False, False]  # label x4 unsupervised
    assert em[0, 3].tolist() == [False, False, False]  # anchor x4 unsupervised
    assert em[0, 4].tolist() == [True, True, False]  # x5 anchor, x6, x7, then past the end
    assert not em[0, 6:].any()
    model = make_model()
    batch = make_batch()
    out = model(**batch)
    assert torch.equal(
        out.target_ids[:, :, 1],
        torch.cat([batch["input_ids"][:, 3:], torch.zeros(2, 3, dtype=torch.long)], dim=1),
    )


def test_flex_kernel_matches_dense():
    model = make_model(num_draft_layers=2)
    batch = make_batch()
    with torch.no_grad():  # flex_attention has no backward on CPU
        dense = model(**batch).draft_logits
        model.attn_implementation = "flex"
        flex = model(**batch).draft_logits
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_train_serve_parity_with_cache(num_layers):
    """Chain drafting with the cache, teacher-forced, reproduces the TTT logits of each step."""
    model = make_model(num_draft_layers=num_layers)
    batch = make_batch(bsz=1)
    ids, feats = batch["input_ids"], batch["target_hidden_states"]
    train = model(**batch).draft_logits[0]
    with torch.no_grad():
        for t in (0, 3, 7):
            cache = model.new_cache()
            # Context in two chunks (a prefill then a round's verified tokens).
            split = max(t // 2, 1) if t > 0 else 1
            hidden = model.extend(
                model.project_context(feats[:, :split]), ids[:, 1 : split + 1], cache
            )
            if t + 1 > split:
                hidden = model.extend(
                    model.project_context(feats[:, split : t + 1]), ids[:, split + 1 : t + 2], cache
                )
            last = hidden[:, -1:]
            for k in range(4):
                torch.testing.assert_close(
                    model.compute_logits(last)[0, 0], train[t, k], rtol=1e-4, atol=1e-5
                )
                if t + k + 2 >= ids.shape[1]:
                    break
                # Step k + 1 reads the token after the one step k predicted for... x_{t+k+2}.
                last = model.extend(last, ids[:, t + k + 2 : t + k + 3], cache)
            assert cache.seq_length > t + 1


def test_propose_greedy_chain_and_cache_crop():
    model = make_model(num_draft_layers=1)
    batch = make_batch(bsz=1)
    ids, feats = batch["input_ids"], batch["target_hidden_states"]
    cache = model.new_cache()
    start = 5
    with torch.no_grad():
        tokens, logits = model.propose(
            context_features=feats[:, :start],
            next_token_ids=ids[:, 1 : start + 1],
            start=start,
            cache=cache,
        )
        assert tokens.shape == (1, 4) and logits.shape == (1, 4, VOCAB)
        assert cache.seq_length == start
        assert torch.equal(tokens, logits.argmax(-1))
        # The greedy chain is the TTT forward fed with its own tokens.
        forced = ids.clone()
        forced[0, start + 1 : start + 4] = tokens[0, :3]
        train = model(forced, feats, batch["loss_mask"]).draft_logits[0, start - 1]
        torch.testing.assert_close(logits[0], train, rtol=1e-4, atol=1e-5)
        # A second round continues from the cropped cache; a stop token ends the chain.
        stop = {int(tokens[0, 0])}
        more, _ = model.propose(
            context_features=feats[:, start : start + 1],
            next_token_ids=ids[:, start + 1 : start + 2],
            start=start + 1,
            cache=cache,
            num_tokens=3,
            stop_token_ids=stop,
        )
        assert cache.seq_length == start + 1 and 1 <= more.shape[1] <= 3
        with pytest.raises(ValueError, match="context_features"):
            model.propose(
                context_features=feats[:, :2], next_token_ids=ids[:, 1:3], start=9, cache=cache
            )


def test_save_load_round_trip_and_reference_names(tmp_path):
    model = make_model(num_draft_layers=1)
    batch = make_batch()
    save_draft_model(model, tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    # vLLM's Eagle3 format (docs/serving.md), with the reference's fields and names
    assert data["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert data["ttt_length"] == 4 and data["step_loss_decay"] == 0.8
    assert data["target_layer_ids"] == LAYER_IDS and data["num_target_layers"] == 4
    assert data["draft_num_hidden_layers"] == 1 and data["num_hidden_layers"] == 1
    # no block size, faked or saved: a round's γ is T, as the kind says
    assert "block_size" not in data and not hasattr(model.config, "block_size")
    assert kind_of(model).decode.tokens_per_round(model.config) == 4
    names = set(model.state_dict())
    # The reference's parameter names (deepspec/modeling/eagle3/qwen3/modeling.py).
    expected = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.0.{n}.weight"
        for n in (
            "hidden_norm",
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert names == expected
    assert model.state_dict()["layers.0.self_attn.q_proj.weight"].shape == (32, 2 * HIDDEN)
    loaded = load_draft_model(tmp_path / "d")
    assert isinstance(loaded, Qwen3Eagle3Model)
    assert not loaded.embed_tokens.weight.requires_grad and not loaded.lm_head.weight.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).draft_logits, model(**batch).draft_logits)
    # A reference-style directory without our extras loads too; a missing field is named
    # (vLLM's format, whose published checkpoints have no ttt_length, defaults it).
    data["architectures"] = ["Qwen3Eagle3Model"]
    data.pop("draft_num_hidden_layers")
    data.pop("ttt_length")
    (tmp_path / "d" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="ttt_length"):
        load_draft_model(tmp_path / "d")


def test_training_steps_reduce_the_loss():
    model = make_model(num_draft_layers=1).train()
    with torch.no_grad():  # a peaked target distribution, so there is something to learn
        model.lm_head.weight.mul_(4.0)
    model.freeze_shared()
    batch = make_batch(bsz=2, seq=16)
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.requires_grad is False for p in (model.embed_tokens.weight, model.lm_head.weight))
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, taus = [], []
    for _ in range(8):
        loss, metrics = compute_eagle3_loss(model(**batch), step_loss_decay=0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        taus.append(metrics["tau_probabilistic"])
    assert losses[-1] < 0.9 * losses[0], losses
    assert model.lm_head.weight.grad is None and model.fc.weight.grad is not None
    # the metrics are those of plain loops over the same logits, and they follow the training
    with torch.no_grad():
        out = model(**batch)
    _, metrics = compute_eagle3_loss(out, step_loss_decay=0.8)
    rates, tau = naive_acceptance(batch, out.draft_logits, model.lm_head.weight)
    for k, rate in enumerate(rates):
        assert metrics[f"accept_rate@{k}"] == pytest.approx(rate, rel=1e-4), k
    assert metrics["tau_probabilistic"] == pytest.approx(tau, rel=1e-4)
    assert metrics["tau_probabilistic"] > taus[0], taus


def test_config_errors_name_the_field():
    tc = target_config()
    with pytest.raises(ValueError, match="ttt_length"):
        build_eagle3_config(tc, target_layer_ids=LAYER_IDS, ttt_length=0)
    with pytest.raises(ValueError, match="step_loss_decay"):
        build_eagle3_config(tc, target_layer_ids=LAYER_IDS, step_loss_decay=0.0)
    with pytest.raises(ValueError, match="target_layer_ids"):
        build_eagle3_config(tc, target_layer_ids=[2, 1])
    with pytest.raises(ValueError, match="num_draft_layers"):
        build_eagle3_config(tc, target_layer_ids=LAYER_IDS, num_draft_layers=0)
    cfg = build_eagle3_config(tc, target_layer_ids=LAYER_IDS)
    assert cfg.ttt_length == 7 and cfg.step_loss_decay == 0.8 and cfg.num_hidden_layers == 1
    model = build_draft_model(cfg)
    with pytest.raises(ValueError, match="target_hidden_states"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, HIDDEN), torch.ones(1, 4))
    out = model(
        torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 3 * HIDDEN), torch.ones(1, 4)
    )
    with pytest.raises(ValueError, match="target_logits"):
        compute_eagle3_loss(out)


def test_incremental_rounds_match_a_fresh_cache():
    """Rounds with varying accepted lengths reuse the cache exactly like a rebuild from scratch."""
    model = make_model(num_draft_layers=2)
    batch = make_batch(bsz=1, seq=16)
    ids, feats = batch["input_ids"], batch["target_hidden_states"]
    cache = model.new_cache()
    with torch.no_grad():
        for start in (3, 4, 7, 12):  # 1, 3 and 5 newly verified positions per round
            cached = cache.seq_length
            tokens, logits = model.propose(
                context_features=feats[:, cached:start],
                next_token_ids=ids[:, cached + 1 : start + 1],
                start=start,
                cache=cache,
                temperature=0.0,
            )
            fresh_tokens, fresh_logits = model.propose(
                context_features=feats[:, :start],
                next_token_ids=ids[:, 1 : start + 1],
                start=start,
                cache=model.new_cache(),
            )
            assert torch.equal(tokens, fresh_tokens)
            torch.testing.assert_close(logits, fresh_logits, rtol=1e-4, atol=1e-5)
            assert cache.seq_length == start


# each distribution term (drafters/common/divergences.py) on both paths
TERMS = [{}, {"kl": 0.5, "tv": 1.0}, {"lk": 1.0, "jsd": 0.3, "nla": 0.2}, {"rkl": 0.7}]


@pytest.mark.parametrize("terms", TERMS, ids=lambda t: "-".join(t) or "soft-ce")
def test_chunked_loss_matches_reference_loss_metrics_and_gradients(terms):
    from dspark_ds.drafters.eagle3.loss import eagle3_forward_and_loss

    model = make_model(num_draft_layers=1).train()
    model.freeze_shared()
    batch = make_batch(bsz=2, seq=12)
    results = {}
    for impl in ("reference", "chunked"):
        model.zero_grad()
        loss, metrics = eagle3_forward_and_loss(
            model, batch, step_loss_decay=0.8, impl=impl, chunk_rows=5, loss_terms=terms
        )
        assert {f"{name}_loss" for name in terms} <= set(metrics)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[impl] = (loss.item(), metrics, grads)
    (ref_loss, ref_m, ref_g), (ch_loss, ch_m, ch_g) = results["reference"], results["chunked"]
    assert ch_loss == pytest.approx(ref_loss, rel=1e-5)
    assert set(ch_m) == set(ref_m)
    for key, value in ref_m.items():
        assert ch_m[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(ch_g) == set(ref_g) and "fc.weight" in ch_g
    for name, g in ref_g.items():
        torch.testing.assert_close(ch_g[name], g, rtol=1e-4, atol=1e-6, msg=name)
