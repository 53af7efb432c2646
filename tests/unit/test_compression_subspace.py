"""Protocol Models subspace codec on the project's nano model: the invariant survives training.

Forward with h0 = embed(tok) + E_f[tok], 100 AdamW steps, re-projecting
attn.wo, mlp.w2 and embed onto span(U) after each step; then every layer
boundary minus E_f[tok] must lie in span(U), so the k = d/32 payload
reconstructs h to float tolerance.
"""

from __future__ import annotations

import pytest
import torch

from locomm.compression import get_codec
from locomm.compression.subspace import SubspaceCodec, project_onto_subspace_

pytestmark = pytest.mark.timeout(120)


def _boundaries(model: torch.nn.Module, tok: torch.Tensor, E_f: torch.Tensor) -> list[torch.Tensor]:
    """Residual stream at every layer boundary (after the embedding and after each block)."""
    T = tok.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.embed(tok) + E_f[tok]
    out = [x]
    for layer in model.layers:
        x = layer(x, cos, sin)
        out.append(x)
    return out


def test_subspace_exact_after_100_adamw_steps_on_nano() -> None:
    ModelConfig = pytest.importorskip("locomm.config").ModelConfig
    build_model = pytest.importorskip("locomm.model").build_model
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("nano")
    model = build_model(cfg, seed=0)
    d = cfg.d_model
    codec = SubspaceCodec(d=d, vocab_size=cfg.vocab_size, rate=32)
    assert codec.k == d // 32
    names = project_onto_subspace_(model, codec.U)
    assert "embed" in names and sum(n.endswith("attn.wo") for n in names) == cfg.n_layers
    assert sum(n.endswith("mlp.w2") for n in names) == cfg.n_layers

    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for _ in range(100):
        starts = torch.randint(0, len(text) - 17, (4,), generator=g)
        tok = torch.stack([text[s : s + 16] for s in starts])
        tgt = torch.stack([text[s + 1 : s + 17] for s in starts])
        h = _boundaries(model, tok, codec.E_f)[-1]
        loss = torch.nn.functional.cross_entropy(model.head(model.norm(h)).flatten(0, 1), tgt.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        project_onto_subspace_(model, codec.U)
        losses.append(loss.item())
    assert sum(losses[-10:]) < sum(losses[:10])  # it trained

    with torch.no_grad():
        for h in _boundaries(model, tok, codec.E_f):
            assert codec.residual_norm(h, tok) < 1e-5
            y = codec.decode(codec.encode(h, tokens=tok))
            torch.testing.assert_close(y, h, rtol=1e-4, atol=1e-5)
            assert len(codec.encode(h, tokens=tok)) < h.numel() * 4 / 8  # k = d/32 (+ token ids)
    # and the bf16 + lossless stack keeps the error at bf16 level
    stack = get_codec("subspace+bf16+lossless", subspace=dict(d=d, vocab_size=cfg.vocab_size, rate=32))
    y = stack.decode(stack.encode(h, tokens=tok))
    assert float((y - h).norm() / h.norm()) < 1e-2


def test_projection_patterns_are_parameters() -> None:
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(4, 16, bias=True))
    U = SubspaceCodec(d=16, vocab_size=2, k=3).U
    with pytest.raises(ValueError):
        project_onto_subspace_(model, U)
    assert project_onto_subspace_(model, U, wo_pattern="proj", w2_pattern=(), embed_name=None) == ["proj"]
    w = model.proj.weight.detach()
    torch.testing.assert_close(U @ (U.T @ w), w, atol=1e-6, rtol=0)
    torch.testing.assert_close(U @ (U.T @ model.proj.bias.detach()), model.proj.bias.detach(), atol=1e-6, rtol=0)
