"""Hybrid loss terms against naive loops, pair sampling, convergence with the tiny mapper, metrics."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
from proxykv_hf.train.losses import LossConfig, hybrid_loss, sample_pairs
from proxykv_hf.train.metrics import mass_recovery, order_desc, topk_count, topk_mask, topk_recall

ONLY = {name: dict(lambda_bin=0.0, lambda_mse=0.0, lambda_fine=0.0, lambda_global=0.0, lambda_cos=0.0)
        | {f"lambda_{name}": 1.0} for name in ("bin", "mse", "fine", "global", "cos")}


def batch(seed: int = 0, shape=(2, 3, 13)):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=g) * 2
    target = torch.rand(shape, generator=g) ** 3  # long-tailed, no ties
    mask = torch.ones(shape[0], shape[-1], dtype=torch.bool)
    mask[1, -4:] = False
    return logits, target, mask


def rows(logits, target, mask):
    """Python lists per row: (x, y) restricted to real tokens."""
    m = mask[:, None, :].expand_as(target).reshape(-1, target.shape[-1])
    out = []
    for x, y, v in zip(logits.reshape(m.shape).tolist(), target.reshape(m.shape).tolist(), m.tolist()):
        keep = [t for t in range(len(v)) if v[t]]
        out.append(([x[t] for t in keep], [y[t] for t in keep]))
    return out


def top_set(y, ratio):
    k = math.ceil(ratio * len(y) - 1e-9)
    return set(sorted(range(len(y)), key=lambda t: (-y[t], t))[:k])


def sig(v):
    return 1 / (1 + math.exp(-v))


def naive(name, data, cfg):
    if name == "bin":
        total = 0.0
        for r in cfg.ratios:
            vals = [-(math.log(sig(x[t])) if t in top_set(y, r) else math.log(1 - sig(x[t])))
                    for x, y in data for t in range(len(y))]
            total += (cfg.r_min / r) ** cfg.gamma * sum(vals) / len(vals)
        return total
    if name == "mse":
        s_max = max(max(y) for _, y in data)
        vals = [(y[t] + cfg.mse_eps) ** cfg.mse_alpha * (sig(x[t]) * s_max - y[t]) ** 2 for x, y in data
                for t in range(len(y))]
        return sum(vals) / len(vals)
    if name == "cos":
        vals = []
        for x, y in data:
            p = [sig(v) for v in x] if cfg.cos_input == "sigmoid" else x
            dot = sum(a * b for a, b in zip(p, y))
            vals.append(1 - dot / (math.sqrt(sum(a * a for a in p)) * math.sqrt(sum(b * b for b in y))))
        return sum(vals) / len(vals)
    num = den = 0.0
    for x, y in data:
        top, limit = top_set(y, cfg.rank_ratio), cfg.pair_filter * max(y)
        lo, hi = min(y), max(y)
        if name == "fine":
            pairs = itertools.combinations(sorted(top), 2)
        else:
            pairs = ((i, j) for i in top for j in range(len(y)) if j not in top)
        for i, j in pairs:
            dy = y[i] - y[j]
            if abs(dy) < limit:
                continue
            if name == "fine":
                num += abs(dy) * math.log1p(math.exp(-math.copysign(1, dy) * (x[i] - x[j])))
                den += abs(dy)
            else:
                w = min(max(1 + abs((y[i] - lo) / (hi - lo) - (y[j] - lo) / (hi - lo)), 1), 5)
                num += w * max(0.0, cfg.margin - (x[i] - x[j]))
                den += 1
    return num / den


@pytest.mark.parametrize("name", ["bin", "mse", "fine", "global", "cos"])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_term_matches_naive_loop(name, seed):
    logits, target, mask = batch(seed)
    cfg = LossConfig(**ONLY[name], pair_filter=0.05)
    total, terms = hybrid_loss(logits, target, mask, cfg)
    expected = naive(name, rows(logits, target, mask), cfg)
    assert terms[name].item() == pytest.approx(expected, rel=1e-5)
    assert total.item() == pytest.approx(expected, rel=1e-5)
    assert all(terms[other].item() == 0 for other in terms if other != name)


def test_cos_on_logits_and_paper_weighting():
    logits, target, mask = batch(3)
    cfg = LossConfig(**ONLY["cos"], cos_input="logits")
    assert hybrid_loss(logits, target, mask, cfg)[1]["cos"].item() == pytest.approx(
        naive("cos", rows(logits, target, mask), cfg), rel=1e-5)
    paper = LossConfig()
    total, terms = hybrid_loss(logits, target, mask, paper)
    weights = dict(bin=10, mse=20, fine=3, **{"global": 2}, cos=0.5, list=0)
    assert total.item() == pytest.approx(sum(weights[k] * terms[k].item() for k in terms), rel=1e-5)


def test_full_mask_shape_and_gradients():
    logits, target, mask = batch(4)
    full_mask = mask[:, None, :].expand_as(target)
    a = hybrid_loss(logits, target, mask)[0]
    b = hybrid_loss(logits, target, full_mask)[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    x = logits.clone().requires_grad_()
    hybrid_loss(x, target, mask)[0].backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1, :, -4:] == 0).all()
    total, terms = hybrid_loss(logits, target, torch.zeros_like(mask))
    assert total.item() == 0 and all(v.item() == 0 for v in terms.values())


@pytest.mark.parametrize("kind", ["fine", "global"])
def test_sampled_pairs_stay_in_their_sets_and_are_reproducible(kind):
    logits, target, mask = batch(5, shape=(2, 3, 40))
    cfg = LossConfig(max_pairs=7, pair_filter=0.0)
    valid = mask[:, None, :].expand_as(target).reshape(-1, 40)
    y = target.reshape(-1, 40)
    order = order_desc(y, valid)
    i, j, ok = sample_pairs(y, valid, order, cfg, kind, torch.Generator().manual_seed(0))
    i2, j2, _ = sample_pairs(y, valid, order, cfg, kind, torch.Generator().manual_seed(0))
    assert i.shape == (6, 7) and ok.all() and torch.equal(i, i2) and torch.equal(j, j2)
    top = topk_mask(y, cfg.rank_ratio, valid)
    assert top.gather(1, i).all() and (i != j).all() and valid.gather(1, j).all()
    assert top.gather(1, j).all() if kind == "fine" else not top.gather(1, j).any()
    exhaustive = sample_pairs(y, valid, order, dataclasses.replace(cfg, max_pairs=10_000), kind, None)[2]
    k = topk_count(valid.sum(-1), cfg.rank_ratio)
    expected = k * (k - 1) if kind == "fine" else k * (valid.sum(-1) - k)
    assert torch.equal(exhaustive.sum(-1), expected)


def test_sampled_loss_is_bounded_and_close_to_exhaustive():
    logits, target, _ = batch(6, shape=(4, 2, 256))
    full = hybrid_loss(logits, target, config=LossConfig(max_pairs=10**6))[1]
    sampled = hybrid_loss(logits, target, config=LossConfig(max_pairs=512),
                          generator=torch.Generator().manual_seed(0))[1]
    for name in ("fine", "global"):
        assert sampled[name].item() == pytest.approx(full[name].item(), rel=0.15)


def test_total_loss_decreases_with_tiny_mapper():
    torch.manual_seed(0)
    mapper = HybridAxialMapper(MapperConfig.tiny(num_proxy_layers=2, num_proxy_heads=2, num_target_layers=4,
                                                 num_target_heads=2, crop_len=32, stride=16))
    x = torch.rand(4, 2, 2, 32) ** 4  # (B, L_s, H_s, N)
    mix = torch.tensor([[1.0, 0.2], [0.3, 1.0]])
    y = torch.einsum("hs,blsn->blhn", mix, x[:, mapper.pairing()])  # (B, L_l, H_l, N)
    y = y / y.amax(-1, keepdim=True)
    opt = torch.optim.AdamW(mapper.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        loss, _ = hybrid_loss(mapper(x), y, generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("bad", [
    dict(lambda_bin=-1.0), dict(lambda_mse=math.inf), dict(ratios=()), dict(ratios=(0.1, 1.5)),
    dict(r_min=0.0), dict(rank_ratio=1.2), dict(pair_filter=1.0), dict(max_pairs=0), dict(max_pairs=2.5),
    dict(cos_input="raw"), dict(global_weight_max=0.5), dict(margin=-1.0),
])
def test_bad_loss_config_raises(bad):
    with pytest.raises(ValueError):
        LossConfig(**bad)


def test_loss_config_roundtrip_and_shape_errors():
    cfg = LossConfig(ratios=[0.1, 0.2])
    assert cfg.ratios == (0.1, 0.2) and LossConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="shapes differ"):
        hybrid_loss(torch.zeros(2, 5), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="mask"):
        hybrid_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), torch.ones(4, 5))


# ---- metrics -------------------------------------------------------------------------------------------


def test_topk_count_is_float_safe():
    assert topk_count(torch.tensor([30, 10, 7, 0]), 0.1).tolist() == [3, 1, 1, 0]
    with pytest.raises(ValueError, match="1.5"):
        topk_count(torch.tensor([3]), 1.5)


def test_metrics_hand_made():
    target = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    pred = torch.tensor([[0.0, 0.0, 1.0, 2.0]])
    assert mass_recovery(pred, target, 0.5).item() == pytest.approx(0.3)
    assert mass_recovery(pred, target, 0.5, relative=True).item() == pytest.approx(3 / 7)
    assert topk_recall(pred, target, 0.5).item() == 0
    assert mass_recovery(target, target, 0.5, relative=True).item() == pytest.approx(1.0)
    assert topk_recall(target, target, 0.25).item() == 1
    assert mass_recovery(pred, target, 1.0).item() == pytest.approx(1.0)
    # ties break by position: all-equal predictions keep the first tokens
    assert mass_recovery(torch.zeros(1, 4), target, 0.5).item() == pytest.approx(0.7)


def test_metrics_respect_mask_and_shapes():
    target = torch.tensor([[[10.0, 1.0, 1.0, 2.0]], [[1.0, 2.0, 3.0, 4.0]]])  # (B=2, H=1, N=4)
    pred = torch.tensor([[[100.0, 0.0, 0.0, 1.0]], [[4.0, 3.0, 2.0, 1.0]]])
    mask = torch.tensor([[False, True, True, True], [True, True, True, True]])  # (B, N)
    per_row = mass_recovery(pred, target, 1 / 3, mask, reduction="none")
    assert per_row.shape == (2, 1)
    assert per_row[0, 0].item() == pytest.approx(0.5)  # K=1 of 3 real tokens: token 3 holds 2 of 4
    assert per_row[1, 0].item() == pytest.approx(0.3)  # K=2 of 4: tokens 0, 1 hold 3 of 10
    assert topk_recall(pred, target, 1 / 3, mask, reduction="none").tolist() == [[1.0], [0.0]]
    kept = topk_mask(pred, 0.5, mask)
    assert not kept[0, 0, 0] and kept.sum().item() == 4


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=30), st.floats(0.01, 1.0), st.integers(0, 2**31))
def test_topk_mask_invariants(values, keep_ratio, seed):
    scores = torch.tensor([values], dtype=torch.float32)
    mask = torch.rand(1, len(values), generator=torch.Generator().manual_seed(seed)) < 0.7
    kept = topk_mask(scores, keep_ratio, mask)
    n_valid = int(mask.sum())
    assert int(kept.sum()) == math.ceil(keep_ratio * n_valid - 1e-9) and not (kept & ~mask).any()
    if kept.any() and (mask & ~kept).any():
        assert scores[kept].min() >= scores[mask & ~kept].max()

