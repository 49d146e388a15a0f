"""The distribution terms and position schedules of the loss (drafters/common/divergences.py,
docs/algorithm.md#distribution-terms-and-position-schedules): each against a hand computation on a
tiny batch (plain `math` on the probabilities, not the module's torch expressions), the DSpark loss
with them on, its denominators over ranks, and the options' errors."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch

from dspark_ds.drafters.common import divergences as dv
from dspark_ds.drafters.dspark import loss as dspark_loss_module
from dspark_ds.drafters.dspark.blocks import DSparkForwardOutput
from dspark_ds.drafters.dspark.config import DSPARK_LOSS, LossWeights
from dspark_ds.drafters.dspark.loss import compute_dspark_loss, dspark_loss, plan_loss
from dspark_ds.drafters.presets import preset
from dspark_ds.errors import ConfigError

# Two slots over a vocabulary of 3: the target's p and the draft's q, given as probabilities;
# their logarithms are the logits (softmax(log p) = p).
P = [[0.5, 0.25, 0.25], [0.7, 0.2, 0.1]]
Q = [[0.25, 0.5, 0.25], [0.1, 0.3, 0.6]]
# the CE term alone, what the schedules weight in their tests
CE_ONLY = dict(ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)


def _logits(rows):
    return torch.tensor(rows, dtype=torch.float64).log().float()


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def _overlap(p, q):
    return sum(min(x, y) for x, y in zip(p, q))


def _hand(name, p, q, eta=dv.LK_ETA):
    """The term `name` of one slot, by hand."""
    alpha = _overlap(p, q)
    if name == "kl":
        return _kl(p, q)
    if name == "rkl":
        return _kl(q, p)
    if name == "jsd":
        m = [(x + y) / 2 for x, y in zip(p, q)]
        return 0.5 * _kl(p, m) + 0.5 * _kl(q, m)
    if name == "tv":
        return 1 - alpha
    if name == "nla":
        return -math.log(alpha)
    lam = math.exp(-eta * alpha)
    return lam * _kl(p, q) + (1 - lam) * (1 - alpha)


def test_the_hand_values_are_the_textbook_ones():
    # slot 0: overlap 0.25 + 0.25 + 0.25 = 0.75; KL(p‖q) = 0.5 ln 2 - 0.25 ln 2 = 0.25 ln 2
    assert _overlap(P[0], Q[0]) == pytest.approx(0.75)
    assert _hand("kl", P[0], Q[0]) == pytest.approx(0.25 * math.log(2))
    assert _hand("rkl", P[0], Q[0]) == pytest.approx(0.25 * math.log(2))  # symmetric here
    # slot 1: overlap 0.1 + 0.2 + 0.1 = 0.4, so TV 0.6 and nla -ln 0.4
    assert _hand("tv", P[1], Q[1]) == pytest.approx(0.6)
    assert _hand("nla", P[1], Q[1]) == pytest.approx(-math.log(0.4))
    assert 0 < _hand("jsd", P[1], Q[1]) < math.log(2)


@pytest.mark.parametrize("name", dv.TERMS)
def test_each_term_is_its_hand_computation(name):
    got = dv.slot_divergences(_logits(Q), _logits(P), [name])
    assert set(got) == {name} and got[name].dtype == torch.float32
    want = [_hand(name, p, q) for p, q in zip(P, Q)]
    assert got[name].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_lk_blends_kl_and_tv_by_the_detached_overlap():
    for eta in (0.0, 1.5):
        got = dv.slot_divergences(_logits(Q), _logits(P), ["lk"], lk_eta=eta)["lk"]
        want = [_hand("lk", p, q, eta) for p, q in zip(P, Q)]
        assert got.tolist() == pytest.approx(want, rel=1e-5)
    # η = 0: λ = 1, plain KL; and λ carries no gradient: d lk = λ d kl + (1 - λ) d tv
    x = _logits(Q).requires_grad_(True)
    terms = dv.slot_divergences(x, _logits(P), ["lk", "kl", "tv"], lk_eta=1.5)
    lam = [math.exp(-1.5 * _overlap(p, q)) for p, q in zip(P, Q)]
    (g_lk,) = torch.autograd.grad(terms["lk"].sum(), x, retain_graph=True)
    (g_kl,) = torch.autograd.grad(terms["kl"].sum(), x, retain_graph=True)
    (g_tv,) = torch.autograd.grad(terms["tv"].sum(), x)
    lam_t = torch.tensor(lam).unsqueeze(-1)
    torch.testing.assert_close(g_lk, lam_t * g_kl + (1 - lam_t) * g_tv)


def test_nla_gradient_is_the_tv_gradient_over_the_overlap():
    x = _logits(Q).requires_grad_(True)
    terms = dv.slot_divergences(x, _logits(P), ["nla", "tv"])
    (g_nla,) = torch.autograd.grad(terms["nla"].sum(), x, retain_graph=True)
    (g_tv,) = torch.autograd.grad(terms["tv"].sum(), x)
    alpha = torch.tensor([_overlap(p, q) for p, q in zip(P, Q)]).unsqueeze(-1)
    torch.testing.assert_close(g_nla, g_tv / alpha)


def test_kl_gradient_is_q_minus_p():
    # d KL(p‖softmax(z)) / dz = q - p, by hand
    x = _logits(Q).requires_grad_(True)
    (g,) = torch.autograd.grad(dv.slot_divergences(x, _logits(P), ["kl"])["kl"].sum(), x)
    want = [[qi - pi for pi, qi in zip(p, q)] for p, q in zip(P, Q)]
    assert g.flatten().tolist() == pytest.approx(sum(want, []), abs=1e-6)


def test_bf16_logits_give_fp32_terms_on_their_device():
    got = dv.slot_divergences(_logits(Q).bfloat16(), _logits(P).bfloat16(), dv.TERMS)
    for name, value in got.items():
        assert value.dtype == torch.float32 and value.device == torch.device("cpu"), name
        want = [_hand(name, p, q) for p, q in zip(P, Q)]
        assert value.tolist() == pytest.approx(want, rel=0.05, abs=0.01), name


def test_nla_is_finite_without_overlap():
    big = torch.tensor([[40.0, 0.0, 0.0]])
    got = dv.slot_divergences(big, big.flip(-1), ["nla"])["nla"]
    assert got.item() == pytest.approx(-math.log(dv.NLA_EPS))


# ---- the schedules -----------------------------------------------------------------------------
VALID = torch.tensor([[True, True, False], [True, True, True]])


def test_exp_and_geometric_schedules():
    exp = dv.static_position_weights(VALID, "exp", decay_gamma=4.0, decay_ratio=0.5)
    want = [[1, math.exp(-1 / 4), 0], [1, math.exp(-1 / 4), math.exp(-2 / 4)]]
    assert exp.flatten().tolist() == pytest.approx(sum(want, []))
    geo = dv.static_position_weights(VALID, "geometric", decay_gamma=4.0, decay_ratio=0.5)
    assert geo.flatten().tolist() == pytest.approx([1, 0.5, 0, 1, 0.5, 0.25])
    flat = dv.static_position_weights(VALID, "exp", decay_gamma=None, decay_ratio=0.5)
    assert flat.flatten().tolist() == [1, 1, 0, 1, 1, 1]


def test_dpace_weights_by_hand():
    ce = torch.tensor([[0.5, 1.0, 9.0], [0.2, 0.7, 0.1]])
    a = 0.5
    s = [[(1 - a) * math.exp(-c) + a for c in row] for row in ce.tolist()]
    # block 0: slot 2 unsupervised (weight 0, counted as s = 1); block 1: all three
    want = [
        [s[0][0] + s[0][0] * s[0][1], s[0][0] * s[0][1], 0.0],
        [
            s[1][0] + s[1][0] * s[1][1] + s[1][0] * s[1][1] * s[1][2],
            s[1][0] * s[1][1] + s[1][0] * s[1][1] * s[1][2],
            s[1][0] * s[1][1] * s[1][2],
        ],
    ]
    got = dv.dpace_weights(ce.requires_grad_(True), VALID, a)
    assert not got.requires_grad
    assert got.flatten().tolist() == pytest.approx(sum(want, []), rel=1e-6)


def test_dpace_skips_a_hole_in_the_mask():
    ce = torch.tensor([[0.3, float("nan"), 0.6]])
    s0, s2 = 0.5 * math.exp(-0.3) + 0.5, 0.5 * math.exp(-0.6) + 0.5
    got = dv.dpace_weights(ce, torch.tensor([[True, False, True]]), 0.5)
    assert got.flatten().tolist() == pytest.approx([s0 + s0 * s2, 0.0, s0 * s2])


# ---- the DSpark loss with them -----------------------------------------------------------------
def _out(with_target=True, conf=False):
    """One block of two slots (B = A = 1, G = 2, V = 3): the draft Q, the target P, labels 0 and
    2, both supervised."""
    return DSparkForwardOutput(
        draft_logits=_logits(Q).view(1, 1, 2, 3).requires_grad_(True),
        target_ids=torch.tensor([[[0, 2]]]),
        eval_mask=torch.ones(1, 1, 2, dtype=torch.bool),
        block_keep_mask=torch.ones(1, 1, dtype=torch.bool),
        confidence_pred=torch.zeros(1, 1, 2) if conf else None,
        aligned_target_logits=_logits(P).view(1, 1, 2, 3) if with_target else None,
    )


CE = [-math.log(Q[0][0]), -math.log(Q[1][2])]
L1 = [2 * _hand("tv", p, q) for p, q in zip(P, Q)]


def test_the_loss_with_terms_is_its_hand_computation():
    w = [1.0, math.exp(-1 / 4)]
    terms = {"kl": 0.3, "tv": 0.5, "nla": 0.2}
    loss, m = compute_dspark_loss(
        _out(), ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=0.0, loss_terms=terms
    )

    def mean(values):
        return sum(wj * v for wj, v in zip(w, values)) / sum(w)

    hand = {n: mean([_hand(n, p, q) for p, q in zip(P, Q)]) for n in terms}
    want = 0.1 * mean(CE) + 0.9 * mean(L1) + sum(a * hand[n] for n, a in terms.items())
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert m["loss"] == pytest.approx(want, rel=1e-5)
    for name in terms:
        assert m[f"{name}_loss"] == pytest.approx(hand[name], rel=1e-5)
    assert "jsd_loss" not in m and "lk_loss" not in m  # only the active terms are logged


def test_dpace_loss_is_its_hand_computation():
    # D-PACE on CE: weights from the CE itself, the mean over the 2 supervised slots
    s = [0.5 * math.exp(-c) + 0.5 for c in CE]
    w = [s[0] + s[0] * s[1], s[0] * s[1]]
    loss, m = compute_dspark_loss(
        _out(),
        **CE_ONLY,
        loss_schedule="dpace",
        loss_terms={"jsd": 2.0},
    )
    jsd = [_hand("jsd", p, q) for p, q in zip(P, Q)]
    want_ce = (w[0] * CE[0] + w[1] * CE[1]) / 2
    want_jsd = (w[0] * jsd[0] + w[1] * jsd[1]) / 2
    assert m["ce_loss"] == pytest.approx(want_ce, rel=1e-5)
    assert m["jsd_loss"] == pytest.approx(want_jsd, rel=1e-5)
    assert loss.item() == pytest.approx(want_ce + 2.0 * want_jsd, rel=1e-5)


def test_dpace_keeps_the_exp_weights_for_the_confidence_head():
    out = _out(conf=True)
    args = dict(ce_loss_alpha=0.0, l1_loss_alpha=0.0, confidence_head_alpha=1.0)
    _, exp = compute_dspark_loss(out, **args)
    _, dpace = compute_dspark_loss(out, loss_schedule="dpace", **args)
    assert dpace["confidence_loss"] == pytest.approx(exp["confidence_loss"], rel=1e-6)


def test_geometric_schedule_weights_the_loss():
    loss, _ = compute_dspark_loss(
        _out(),
        **CE_ONLY,
        loss_schedule="geometric",
        loss_decay_ratio=0.5,
    )
    assert loss.item() == pytest.approx((CE[0] + 0.5 * CE[1]) / 1.5, rel=1e-5)


def test_default_options_leave_the_loss_unchanged():
    out = _out(conf=True)
    base, m = compute_dspark_loss(out, **asdict(DSPARK_LOSS))
    zero, m0 = compute_dspark_loss(
        out, **dict(asdict(DSPARK_LOSS), loss_terms={"kl": 0.0}, lk_eta=9.0)
    )
    assert zero.item() == base.item() and m0 == m
    assert DSPARK_LOSS.loss_terms == () and DSPARK_LOSS.loss_schedule == "exp"


def test_denominators_and_coefficients_over_ranks(monkeypatch):
    """Two ranks with the same block: the denominators are summed over them and the
    coefficient carries `· world_size`, so the loss equals one rank's (docs/algorithm.md)."""
    out = _out()
    weights = LossWeights(4.0, 0.1, 0.9, 0.0, loss_terms={"kl": 0.3, "lk": 0.5})
    one = dspark_loss(out, weights)
    dist = dspark_loss_module.distributed
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce_", lambda t: t.mul_(2))  # the other rank's = ours
    plan = plan_loss(out.eval_mask, weights, has_aligned=True, has_confidence=False)
    den = 1.0 + math.exp(-1 / 4)
    for name, alpha in weights.loss_terms:
        assert plan.coef_terms[name].item() == pytest.approx(alpha * 2 / (2 * den + 1e-6))
    two = dspark_loss(out, weights)
    assert two.loss.item() == pytest.approx(one.loss.item(), rel=1e-6)
    # D-PACE: the denominator is the supervised slots' count, summed over the ranks
    dpace = LossWeights(4.0, 1.0, 0.0, 0.0, loss_terms={"tv": 1.0}, loss_schedule="dpace")
    plan = plan_loss(out.eval_mask, dpace, has_aligned=True, has_confidence=False)
    assert plan.coef_terms["tv"].item() == pytest.approx(2 / (2 * 2 + 1e-6))
    assert plan.coef_ce.item() == pytest.approx(2 / (2 * 2 + 1e-6))


# ---- the options -------------------------------------------------------------------------------
def test_unknown_term_or_schedule_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"model\.loss_terms: unknown term 'kld'; choose from kl"):
        preset("dspark", loss_terms={"kld": 1.0}).validate()
    with pytest.raises(ConfigError, match=r"model\.loss_terms: the weight of 'tv'"):
        preset("dspark", loss_terms={"tv": -1.0}).validate()
    with pytest.raises(ConfigError, match=r"model\.loss_schedule: unknown schedule 'lin'; choose"):
        preset("dspark", loss_schedule="lin").validate()
    with pytest.raises(ConfigError, match="dpace_alpha"):
        preset("dspark", loss_schedule="dpace", dpace_alpha=0.0).validate()
    with pytest.raises(ConfigError, match="unknown schedule"):
        LossWeights(4.0, 1.0, 0.0, 0.0, loss_schedule="linear")


def test_a_term_alone_trains_dflash():
    cfg = preset("dflash", ce_loss_alpha=0.0, loss_terms={"kl": 1.0}).validate()
    assert LossWeights.of(cfg).loss_terms == (("kl", 1.0),)
    with pytest.raises(ConfigError, match="nothing would be trained"):
        preset("dflash", ce_loss_alpha=0.0).validate()


def test_term_spec_forms():
    assert dv.parse_terms('{"tv": 0.9}') == (("tv", 0.9),)  # the peer's JSON form
    assert dv.parse_terms("kl") == (("kl", 1.0),)
    assert dv.parse_terms({"tv": 0.5, "kl": 0.0, "jsd": 1}) == (("jsd", 1.0), ("tv", 0.5))


def test_a_term_without_aligned_target_logits_is_one_line():
    with pytest.raises(ValueError, match=r"loss_terms \{'tv': 1.0\} need aligned_target_logits"):
        compute_dspark_loss(_out(with_target=False), l1_loss_alpha=0.0, loss_terms={"tv": 1.0})


# ---- Eagle3 ------------------------------------------------------------------------------------
def test_eagle3_terms_are_their_hand_computation():
    """Positions t = 0, 1, steps k = 0, 1 (V = 3): step k at t is compared with the target's
    row t + k + 1. Supervised: (0, 0) → row 1 (P[0]), (0, 1) → row 2 (P[1]), (1, 0) → row 2."""
    from dspark_ds.drafters.eagle3.loss import compute_eagle3_loss
    from dspark_ds.drafters.eagle3.model import Eagle3ForwardOutput

    uniform = [1 / 3] * 3
    draft = [[Q[0], Q[1]], [Q[1], uniform], [uniform, uniform]]  # [S = 3, T = 2, V]
    target = [uniform, P[0], P[1]]  # [S, V]: row 0 is never compared
    out = Eagle3ForwardOutput(
        draft_logits=_logits(draft).view(1, 3, 2, 3).requires_grad_(True),
        target_ids=torch.zeros(1, 3, 2, dtype=torch.long),
        eval_mask=torch.tensor([[[True, True], [True, False], [False, False]]]),
        target_logits=_logits(target).view(1, 3, 3),
    )
    terms = {"tv": 0.5, "rkl": 0.25}
    loss, m = compute_eagle3_loss(out, step_loss_decay=0.5, loss_terms=terms)

    def soft_ce(p, q):
        return -sum(x * math.log(y) for x, y in zip(p, q))

    def slot(p, q):
        return soft_ce(p, q) + sum(a * _hand(n, p, q) for n, a in terms.items())

    step0 = (slot(P[0], Q[0]) + slot(P[1], Q[1])) / 2  # (t=0, k=0) and (t=1, k=0)
    step1 = slot(P[1], Q[1])  # (t=0, k=1)
    assert loss.item() == pytest.approx(step0 + 0.5 * step1, rel=1e-5)
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5)
    tv = (_hand("tv", P[0], Q[0]) + _hand("tv", P[1], Q[1])) / 2 + 0.5 * _hand("tv", P[1], Q[1])
    assert m["tv_loss"] == pytest.approx(tv, rel=1e-5)


def test_a_masked_token_gives_finite_terms_and_gradients():
    """A token both sides give −inf (a masked vocabulary entry) adds nothing, NaN-free."""
    draft = torch.tensor([[0.0, 1.0, float("-inf")]], requires_grad=True)
    target = torch.tensor([[1.0, 0.0, float("-inf")]])
    got = dv.slot_divergences(draft, target, dv.TERMS)
    want = dv.slot_divergences(draft[:, :2], target[:, :2], dv.TERMS)
    for name in dv.TERMS:
        torch.testing.assert_close(got[name], want[name], msg=name)
    (g,) = torch.autograd.grad(sum(v.sum() for v in got.values()), draft)
    assert torch.isfinite(g).all() and g[0, 2] == 0
