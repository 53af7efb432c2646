import pytest
import torch

from locomm.config import ModelConfig
from locomm.model import build_model


def test_preset_sizes():
    assert build_model(ModelConfig.from_preset("nano")).num_parameters() < 1_000_000
    assert 5_000_000 <= build_model(ModelConfig.from_preset("tiny")).num_parameters() <= 10_000_000


def test_init_is_deterministic_from_seed():
    cfg = ModelConfig.from_preset("nano")
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n


def test_forward_shapes_loss_and_tying():
    cfg = ModelConfig.from_preset("nano")
    m = build_model(cfg)
    x = torch.randint(0, 256, (2, 16))
    assert m(x).shape == (2, 16, cfg.vocab_size)
    loss = m(x, torch.randint(0, 256, (2, 16)))
    # A fresh model is close to uniform over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.2
    assert m.head.weight is m.embed.weight
    untied = build_model(ModelConfig.from_preset("nano", tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight


def test_causal():
    m = build_model(ModelConfig.from_preset("nano"))
    x = torch.randint(0, 256, (1, 32))
    y = x.clone()
    y[0, 20:] = (y[0, 20:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :20], m(y)[0, :20], atol=1e-5)
        assert not torch.allclose(m(x)[0, 20:], m(y)[0, 20:], atol=1e-5)


def test_rotary_is_relative():
    """Attention scores depend on positions only through their difference."""
    from locomm.model.llama import apply_rotary, rotary_tables

    cos, sin = rotary_tables(16, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        qi = apply_rotary(q, cos[i : i + 1], sin[i : i + 1])
        kj = apply_rotary(k, cos[j : j + 1], sin[j : j + 1])
        return (qi * kj).sum().item()

    assert score(5, 2) == pytest.approx(score(40, 37), rel=1e-4)


def test_too_long_sequence_is_a_clear_error():
    m = build_model(ModelConfig.from_preset("nano"))
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 129, dtype=torch.long))
