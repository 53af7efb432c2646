import math

import pytest
import torch

from locomm.optim import AdamS, cosine_with_warmup


def adams_reference(theta, grads, lr, b1, b2, eps, wd, bias_correction=True):
    """docs/algorithms.md §5, line by line, on plain tensors (without the correction: the paper's equations as
    quoted, m_t / (sqrt(b2 m_{t-1}^2 + (1 - b2) g_t^2) + eps))."""
    theta = theta.clone()
    m = torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        bc = 1 - b1**t if bias_correction else 1.0
        theta = (1 - lr * wd) * theta
        mh = m / bc
        v = b2 * mh**2 + (1 - b2) * g**2
        m = b1 * m + (1 - b1) * g
        theta = theta - lr * (m / bc) / (torch.sqrt(v) + eps)
    return theta, m


@pytest.mark.parametrize("bias_correction", [True, False])
def test_adams_matches_reference(bias_correction):
    torch.manual_seed(0)
    theta0 = torch.randn(7, 5, dtype=torch.float64)
    grads = [torch.randn(7, 5, dtype=torch.float64) for _ in range(12)]
    p = torch.nn.Parameter(theta0.clone())
    opt = AdamS([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, bias_correction=bias_correction)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref, m = adams_reference(theta0, grads, 0.01, 0.9, 0.95, 1e-8, 0.1, bias_correction)
    assert torch.allclose(p.detach(), ref, atol=1e-6)
    assert torch.allclose(opt.state[p]["exp_avg"].double(), m, atol=1e-6)


@pytest.mark.parametrize(
    ("bias_correction", "first_step"), [(True, 1 / math.sqrt(0.05)), (False, 0.1 / math.sqrt(0.05))]
)
def test_adams_first_step(bias_correction, first_step):
    p = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
    opt = AdamS([p], lr=1.0, betas=(0.9, 0.95), eps=1e-30, weight_decay=0.0, bias_correction=bias_correction)
    p.grad = torch.full_like(p, 0.3)
    opt.step()
    assert torch.allclose(p.detach(), torch.full_like(p, -first_step))


def test_adams_trains():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(10))
    opt = AdamS([w], lr=0.05, weight_decay=0.0)
    for _ in range(300):
        opt.zero_grad()
        (w - 3).pow(2).sum().backward()
        opt.step()
    assert torch.allclose(w.detach(), torch.full((10,), 3.0), atol=0.05)


def test_adams_rejects_bad_hyperparameters():
    with pytest.raises(ValueError):
        AdamS([torch.nn.Parameter(torch.zeros(1))], lr=-1)


def test_cosine_with_warmup():
    assert cosine_with_warmup(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert cosine_with_warmup(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert cosine_with_warmup(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert cosine_with_warmup(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(500, 10, 100, 0.1) == pytest.approx(0.1)
