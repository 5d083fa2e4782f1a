"""HybridAxialMapper: stage shapes, parameter budget, windowed encoder, pairing, ablations, config checks."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proxykv_hf.mapper.model import (HybridAxialMapper, MapperConfig, TimeEncoder, mask_padding, sinusoidal_encoding,
                                     window_starts)

LLAMA_1B_TO_8B = dict(num_proxy_layers=16, num_proxy_heads=32, num_target_layers=32, num_target_heads=8)


def tiny(**kwargs) -> HybridAxialMapper:
    torch.manual_seed(0)
    return HybridAxialMapper(MapperConfig.tiny(**kwargs)).eval()


def test_stage_shapes():
    m = tiny(num_proxy_layers=3, num_proxy_heads=4, num_target_layers=5, num_target_heads=6)
    cfg = m.config
    x = torch.rand(2, 3, 4, 20)  # (B, L_s, H_s, N)
    z_local = m.stem(x[:, 0])
    assert z_local.shape == (2, cfg.d_time, 20)
    z_global = m.time_encoder(z_local.transpose(1, 2))
    assert z_global.shape == (2, 20, cfg.d_time)
    assert m.head(z_global).shape == (2, 6, 20)
    assert m(x).shape == (2, 5, 6, 20)
    assert m.forward_layer(x[:, 1], 2).shape == (2, 6, 20)


def test_paper_preset_parameter_split():
    cfg = MapperConfig.paper(**LLAMA_1B_TO_8B)
    assert (cfg.d_time, cfg.num_encoder_layers, cfg.num_encoder_heads, cfg.crop_len, cfg.stride) == (
        512, 6, 8, 2048, 1024)
    counts = HybridAxialMapper(cfg).num_parameters_by_stage()
    for stage, stated in {"stem": 0.5e6, "encoder": 13e6, "head": 1.5e6}.items():
        assert abs(counts[stage] - stated) <= 0.2 * stated, (stage, counts[stage])
    assert abs(sum(counts.values()) - 15e6) <= 0.1 * 15e6


@pytest.mark.parametrize("l_s,l_l", [(16, 32), (28, 28), (3, 7), (36, 64), (5, 3)])
def test_pairing_formula(l_s, l_l):
    cfg = MapperConfig.tiny(num_proxy_layers=l_s, num_target_layers=l_l)
    assert cfg.pairing() == [math.ceil(l * l_s / l_l) - 1 for l in range(1, l_l + 1)]
    assert HybridAxialMapper(cfg).pairing() == cfg.pairing()


def test_pairing_llama_example():
    assert MapperConfig.paper(**LLAMA_1B_TO_8B).pairing()[:6] == [0, 0, 1, 1, 2, 2]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 80), st.integers(1, 80))
def test_pairing_invariants(l_s, l_l):
    p = MapperConfig.tiny(num_proxy_layers=l_s, num_target_layers=l_l).pairing()
    assert len(p) == l_l and p[-1] == l_s - 1 and min(p) >= 0
    assert all(a <= b for a, b in zip(p, p[1:]))


def test_window_starts():
    assert window_starts(37, 16, 8) == [0, 8, 16, 21]
    assert window_starts(32, 16, 8) == [0, 8, 16]
    assert window_starts(16, 16, 8) == [0]
    assert window_starts(5, 16, 8) == [0]


@pytest.mark.parametrize("n", [5, 12, 16])
def test_windowed_encoder_equals_single_pass_when_short(n):
    m = tiny(crop_len=16, stride=8)
    long = HybridAxialMapper(MapperConfig.tiny(crop_len=4096, stride=8)).eval()
    long.load_state_dict(m.state_dict())
    x = torch.rand(2, 2, 2, n)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, n - 2:] = 0
    with torch.no_grad():
        assert torch.equal(m.encode(x[:, 0], mask), long.encode(x[:, 0], mask))
        assert torch.equal(m(x), long(x))


def naive_windowed(m: HybridAxialMapper, x_layer: torch.Tensor) -> torch.Tensor:
    """Overlap averaging written out: loop windows, add each window's output, divide by cover count."""
    crop, stride = m.config.crop_len, m.config.stride
    z = m.stem(x_layer).transpose(1, 2)
    n = z.shape[1]
    starts, s = [], 0
    while True:
        starts.append(s)
        if s + crop >= n:
            break
        s = min(s + stride, n - crop)
    total, count = torch.zeros_like(z), torch.zeros(n)
    for s in starts:
        total[:, s:s + crop] += m.time_encoder(z[:, s:s + crop])
        count[s:s + crop] += 1
    assert count.min() >= 1
    return total / count[None, :, None]


@pytest.mark.parametrize("n,window_batch", [(37, 8), (37, 1), (32, 2), (17, 8), (100, 3)])
def test_windowed_encoder_matches_naive(n, window_batch):
    m = tiny(crop_len=16, stride=8)
    m.window_batch = window_batch
    x = torch.rand(2, 2, n)
    with torch.no_grad():
        torch.testing.assert_close(m.encode(x), naive_windowed(m, x), rtol=1e-5, atol=1e-5)
        assert m(torch.rand(1, 2, 2, n)).shape == (1, 4, 2, n)


def test_side_by_side_windows_read_each_token_once():
    """stride == crop_len (how the bundled mapper runs): windows tile the tokens, each read by one window, and only
    the last window (ending at n) overlaps its neighbour."""
    m = tiny(crop_len=16, stride=16)
    assert window_starts(48, 16, 16) == [0, 16, 32] and window_starts(40, 16, 16) == [0, 16, 24]
    x = torch.rand(2, 2, 48)
    with torch.no_grad():
        stem = m.stem(x).transpose(1, 2)
        want = torch.cat([m.time_encoder(stem[:, s:s + 16]) for s in (0, 16, 32)], dim=1)
        torch.testing.assert_close(m.encode(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.encode(x), naive_windowed(m, x), rtol=1e-5, atol=1e-5)


def test_windowed_encoder_backward():
    m = tiny(crop_len=16, stride=8).train()
    m(torch.rand(2, 2, 2, 37)).square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_forward_reuses_paired_proxy_layer_and_matches_forward_layer():
    m = tiny(num_proxy_layers=2, num_target_layers=4)
    x = torch.rand(2, 2, 2, 24)
    with torch.no_grad():
        out = m(x)
        for l, p in enumerate(m.pairing()):
            torch.testing.assert_close(out[:, l], m.forward_layer(x[:, p], l))
    assert torch.equal(out[:, 0], out[:, 1]) and not torch.equal(out[:, 1], out[:, 2])


@pytest.mark.parametrize("direct_path", [False, True])
def test_forward_on_a_subset_of_target_layers(direct_path):
    m = tiny(num_proxy_layers=2, num_target_layers=4, direct_path=direct_path)
    if direct_path:
        torch.nn.init.normal_(m.direct.weight)
    x = torch.rand(2, 2, 2, 24)
    with torch.no_grad():
        full = m(x)
        for layers in ([3], [2, 0], [1, 1, 3]):
            torch.testing.assert_close(m(x, target_layers=layers), full[:, layers])
    for bad in ([], [4], [-1]):
        with pytest.raises(ValueError, match="target_layers"):
            m(x, target_layers=bad)


def test_right_padding_does_not_change_real_tokens():
    m = tiny()
    x = torch.rand(1, 2, 2, 20)
    padded = torch.cat([x, 5 * torch.rand(1, 2, 2, 6)], dim=-1)
    mask = torch.cat([torch.ones(1, 20), torch.zeros(1, 6)], dim=-1)
    with torch.no_grad():
        ref, out = m(x), m(padded, mask)
    torch.testing.assert_close(out[..., :20], ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()
    masked = mask_padding(out, mask)
    assert torch.isneginf(masked[..., 20:]).all() and torch.equal(masked[..., :20], out[..., :20])
    fully_padded = m(padded, torch.zeros(1, 26))
    assert torch.isfinite(fully_padded).all()


@pytest.mark.parametrize("padded", [False, True])
def test_cpu_eval_encoder_path_equals_the_module(padded):
    """Eval mode on the CPU runs the encoder through scaled_dot_product_attention on the module's own weights."""
    torch.manual_seed(0)
    enc = TimeEncoder(MapperConfig.tiny(d_time=32, num_encoder_heads=4, num_encoder_layers=2, dropout=0.1)).eval()
    z = torch.randn(3, 40, 32)
    valid = torch.ones(3, 40, dtype=torch.bool)
    if padded:
        valid[1, 25:] = False
    got = enc(z, valid if padded else None)
    pad = ~valid if padded else None
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    ref = enc.encoder(z + sinusoidal_encoding(positions, 32), src_key_padding_mask=pad)
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=1e-5)
    enc.train()  # training keeps the module's path (dropout, autograd through nn.MultiheadAttention)
    torch.manual_seed(1)
    a = enc(z, None)
    torch.manual_seed(1)
    b = enc.encoder(z + sinusoidal_encoding(torch.arange(40).expand(3, -1), 32))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rows", [3, 8])
def test_bfloat16_window_attention_equals_sdpa(monkeypatch, rows):
    """On a CPU under bfloat16 autocast the unpadded windows' attention runs as batched matmuls a few (window, head)
    pairs at a time (the pairs here not a multiple of the batch), and gives what float32 attention gives within
    bfloat16 rounding; padded windows keep sdpa with its mask."""
    from proxykv_hf.mapper import model as mapper_module

    monkeypatch.setattr(mapper_module, "WINDOW_ATTENTION_ROWS", rows)
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 37, 8) for _ in range(3))
    got = mapper_module.window_attention_bf16(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert got.shape == (3, 4, 37, 8) and got.dtype == torch.bfloat16
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    assert (got.float() - want).abs().mean() < 5e-3

    enc = TimeEncoder(MapperConfig.tiny(d_time=32, num_encoder_heads=4, num_encoder_layers=2)).eval()
    z = torch.randn(3, 40, 32)
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[1, 25:] = False
    calls = []
    real = mapper_module.window_attention_bf16
    monkeypatch.setattr(mapper_module, "window_attention_bf16", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        ref = enc(z)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast, padded = enc(z).float(), enc(z, valid).float()
    assert len(calls) == 2  # once per encoder layer, for the unpadded call only
    torch.testing.assert_close(fast, ref, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(padded[valid], enc(z, valid)[valid], atol=5e-2, rtol=5e-2)


def test_stage_sizes():
    cfg = MapperConfig.tiny()
    h_l, d = cfg.num_target_heads, cfg.d_time
    full = tiny().num_parameters_by_stage()
    x = torch.rand(2, 2, cfg.num_proxy_heads, 21)
    assert tiny(input_transform="none")(x).shape == (2, 4, h_l, 21)
    direct = tiny(direct_path=True).num_parameters_by_stage()
    assert direct == {**full, "head": full["head"] + cfg.num_target_layers * h_l * (cfg.num_features + 1)}
    ffn4 = tiny(ffn_mult=4).num_parameters_by_stage()["encoder"]
    assert ffn4 - full["encoder"] == cfg.num_encoder_layers * (4 * d * d + 2 * d)  # FFN width 2d -> 4d


def test_input_transform_log1p_clamps_negative():
    m = tiny()
    with torch.no_grad():
        torch.testing.assert_close(m.stem(torch.full((1, 2, 8), -3.0)), m.stem(torch.zeros(1, 2, 8)))
        assert not torch.allclose(m.stem(torch.full((1, 2, 8), 3.0)),
                                  tiny(input_transform="none").stem(torch.full((1, 2, 8), 3.0)))


def test_input_transform_per_statistic():
    from proxykv_hf.mapper.model import LOG_FLOOR, transform_features

    x = torch.rand(2, 3, 2 * 4, 16)  # (B, L, S * H, N): sums then maxima of 4 heads
    got = transform_features(x, "log1p,log")
    torch.testing.assert_close(got[:, :, :4], torch.log1p(x[:, :, :4]))
    torch.testing.assert_close(got[:, :, 4:], torch.log(x[:, :, 4:] + LOG_FLOOR))
    cfg = MapperConfig.tiny(num_statistics=2, input_transform="log1p,log")
    assert MapperConfig.from_dict(cfg.to_dict()) == cfg
    wide = HybridAxialMapper(cfg)
    assert wide.num_features == cfg.num_features == 4  # 2 statistics x 2 heads
    assert wide(torch.rand(1, 2, 4, 12)).shape == (1, 4, 2, 12)
    with pytest.raises(ValueError, match="expected features of shape"):  # the sums alone
        wide(torch.rand(1, 2, 2, 12))
    for bad in ("log1p,log", "log1p,log,none"):  # one statistic; three transforms for two
        with pytest.raises(ValueError, match="input_transform"):
            MapperConfig.tiny(input_transform=bad, num_statistics=1 if bad == "log1p,log" else 2)


def test_presets_and_json_roundtrip():
    for preset in (MapperConfig.paper, MapperConfig.small, MapperConfig.tiny):
        cfg = preset(**LLAMA_1B_TO_8B)
        assert MapperConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    small = MapperConfig.small(num_proxy_layers=30, num_proxy_heads=9, num_target_layers=30, num_target_heads=3)
    assert small.d_time == 128 and small.num_encoder_layers == 2
    with pytest.raises(ValueError, match="bogus"):
        MapperConfig.from_dict({**MapperConfig.tiny().to_dict(), "bogus": 1})


@pytest.mark.parametrize("bad", [
    dict(num_proxy_heads=0), dict(num_target_layers=-1), dict(d_head=1.5), dict(d_time=True),
    dict(num_encoder_heads=7), dict(stride=65), dict(dropout=1.0), dict(dropout=-0.1),
    dict(input_transform="sqrt"), dict(direct_path=1), dict(direct_context=-1),
])
def test_bad_config_raises(bad):
    (value,) = bad.values()
    with pytest.raises(ValueError, match=re.escape(repr(value))):  # the message quotes the bad value
        MapperConfig.tiny(**bad)


def test_bad_inputs_raise():
    m = tiny()
    with pytest.raises(ValueError, match="shape"):
        m(torch.rand(2, 3, 2, 8))
    with pytest.raises(ValueError, match="attention_mask"):
        m(torch.rand(2, 2, 2, 8), torch.ones(2, 9))
    with pytest.raises(ValueError, match="target_layer_idx"):
        m.forward_layer(torch.rand(2, 2, 8), 4)
    with pytest.raises(ValueError, match="window_batch"):
        HybridAxialMapper(MapperConfig.tiny(), window_batch=0)


def test_forward_encodes_each_distinct_proxy_layer_once(monkeypatch):
    m = tiny(num_proxy_layers=3, num_target_layers=8)
    calls = []
    encode = m.encode
    monkeypatch.setattr(m, "encode", lambda x, mask=None: calls.append(x.shape[0]) or encode(x, mask))
    m.train()(torch.rand(1, 3, 2, 10))
    assert calls == [1] * len(set(m.pairing())) == [1, 1, 1]  # training: one layer per pass (BatchNorm statistics)
    calls.clear()
    m.eval()(torch.rand(1, 3, 2, 10))
    assert calls == [3]  # eval: the three proxy layers as three batch rows of one pass


def test_layer_batch_is_only_a_speed_setting():
    """In eval mode, encoding several proxy layers as one batch gives the scores of one layer at a time."""
    cfg = MapperConfig.tiny(num_proxy_layers=3, num_proxy_heads=4, num_target_layers=5, num_target_heads=2)
    torch.manual_seed(0)
    mapper = HybridAxialMapper(cfg).eval()
    x, mask = torch.rand(2, 3, 4, 40), torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    with torch.no_grad():
        mapper.layer_batch = 1
        one = mapper(x, attention_mask=mask)
        mapper.layer_batch = 3
        torch.testing.assert_close(mapper(x, attention_mask=mask), one, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mapper(x), mapper(x, attention_mask=torch.ones(2, 40)), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ direct path
def test_direct_path_starts_as_a_no_op_and_is_off_by_default():
    assert MapperConfig.paper(**LLAMA_1B_TO_8B).direct_path is False
    assert tiny().direct is None
    base, with_direct = tiny(), tiny(direct_path=True)
    missing, unexpected = with_direct.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == ["direct.bias", "direct.weight"]
    x = torch.rand(2, 2, 2, 40)
    torch.testing.assert_close(with_direct(x), base(x))
    n = with_direct.config
    assert with_direct.num_parameters_by_stage()["head"] - base.num_parameters_by_stage()["head"] == (
        n.num_target_layers * n.num_target_heads * (n.num_proxy_heads + 1))


def test_direct_path_adds_a_per_layer_head_combination():
    m = tiny(direct_path=True)
    base = tiny()
    with torch.no_grad():
        m.direct.weight[3, 1, 0] = 2.0  # target layer 3, KV head 1 reads proxy head 0
        m.direct.bias[3, 1] = 0.5
    x = torch.rand(1, 2, 2, 40)
    x[0, 1, 0, 17] = 50.0  # a one-token spike in proxy layer 1 (paired with target layers 2 and 3), head 0
    out, ref = m(x), base(x)
    torch.testing.assert_close(out[:, :3], ref[:, :3])  # other layers untouched
    f = torch.log1p(x[0, 1, 0])
    torch.testing.assert_close(out[0, 3, 1] - ref[0, 3, 1], 2.0 * (f - f.mean()) + 0.5)
    torch.testing.assert_close(out[:, 3, 0], ref[:, 3, 0])
    torch.testing.assert_close(m.forward_layer(x[:, 1], 3), out[:, 3])
    assert int(out[0, 3, 1].argmax()) == 17


def test_direct_context_reads_the_layers_before_the_paired_one():
    """direct_context=c: target layer l's direct path also reads the c proxy layers before its paired one (zeros
    before the first), in forward (all layers) and forward_layer (given those layers' features) alike."""
    cfg = dict(num_proxy_layers=4, num_target_layers=4, direct_path=True)
    assert MapperConfig.tiny(**cfg, direct_context=2).direct_sources() == [[0, -1, -1], [1, 0, -1], [2, 1, 0],
                                                                           [3, 2, 1]]
    base, m = tiny(**cfg), tiny(**cfg, direct_context=2)
    assert m.direct.weight.shape == (4, 2, 3 * 2)
    m.load_state_dict({k: v for k, v in base.state_dict().items() if k != "direct.weight"}, strict=False)
    x = torch.rand(1, 4, 2, 40)
    torch.testing.assert_close(m(x), base(x))  # context weights at zero: the mapper without context
    with torch.no_grad():
        m.direct.weight[3, 1, 2 + 0] = 2.0  # target layer 3, KV head 1: proxy layer 2 (one back), head 0
        m.direct.weight[1, 0, 4 + 1] = 5.0  # target layer 1, head 0: two back is before layer 0, reads zeros
    x[0, 2, 0, 17] = 50.0
    out, ref = m(x), base(x)
    f = torch.log1p(x[0, 2, 0])
    torch.testing.assert_close(out[0, 3, 1] - ref[0, 3, 1], 2.0 * (f - f.mean()))
    torch.testing.assert_close(out[:, :3], ref[:, :3])
    for l in range(4):
        earlier = [x[:, q] for q in range(l - 1, max(l - 3, -1), -1)]
        torch.testing.assert_close(m.forward_layer(x[:, l], l, earlier=earlier), out[:, l])
    with pytest.raises(ValueError, match="reads 2 earlier proxy layers"):
        m.forward_layer(x[:, 3], 3, earlier=[x[:, 2]])
    with pytest.raises(ValueError, match="needs direct_path=True"):
        MapperConfig.tiny(direct_context=1)
    with pytest.raises(ValueError, match="direct_context must be an int >= 0"):
        MapperConfig.tiny(direct_path=True, direct_context=-1)
    with pytest.raises(ValueError, match="below num_proxy_layers"):
        MapperConfig.tiny(direct_path=True, direct_context=2)  # the tiny preset's proxy has 2 layers


def test_direct_path_ignores_padding():
    m = tiny(direct_path=True)
    with torch.no_grad():
        m.direct.weight.normal_()
        m.direct.bias.normal_()
    x = torch.rand(1, 2, 2, 30)
    padded = torch.cat([torch.rand(1, 2, 2, 6) * 100, x], dim=-1)  # left padding with junk
    mask = torch.cat([torch.zeros(1, 6), torch.ones(1, 30)], dim=-1).long()
    torch.testing.assert_close(m(padded, attention_mask=mask)[..., 6:], m(x), atol=1e-5, rtol=1e-4)


def test_direct_path_config_round_trip():
    cfg = MapperConfig.tiny(direct_path=True)
    assert MapperConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="direct_path"):
        MapperConfig.tiny(direct_path=1)
