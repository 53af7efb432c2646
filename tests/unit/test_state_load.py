"""load_state: a downloaded state fits the model exactly, or nothing is copied (no broadcasting, no KeyError)."""

from __future__ import annotations

import pytest
import torch

from locomm.config import OuterConfig
from locomm.peer.transport.state_sync import StateMismatch, expected_layout, load_state, state_tensors
from locomm.protocol import build_outer


def setup(algo: str = "noloco"):
    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    outer = build_outer(OuterConfig(algo=algo), params, "me")
    return params, outer


def donor_state(params, outer, value: float = 1.5) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in state_tensors(params, outer).items()}


@pytest.mark.parametrize("algo", ["diloco", "noloco", "gasloc", "sparseloco"])
def test_a_state_of_the_right_layout_loads(algo):
    params, outer = setup(algo)
    load_state(donor_state(params, outer), params, outer)
    assert all(torch.equal(p, torch.full_like(p, 1.5)) for p in params.values())
    assert all(torch.equal(v, torch.full_like(v, 1.5)) for v in outer.state_dict().values())
    assert expected_layout(state_tensors(params, outer))["model/w"] == (4, 3)


def test_a_one_element_tensor_is_not_broadcast_into_a_weight():
    params, outer = setup()
    bad = {**donor_state(params, outer), "model/w": torch.tensor([7.0])}
    with pytest.raises(StateMismatch, match="model/w: shape"):
        load_state(bad, params, outer)
    assert torch.equal(params["w"], torch.zeros(4, 3)) and torch.equal(params["b"], torch.zeros(3))


def test_a_missing_name_is_a_clear_error_and_nothing_is_copied():
    params, outer = setup()
    bad = donor_state(params, outer)
    del bad["outer/phi/b"]
    with pytest.raises(StateMismatch, match=r"missing \['outer/phi/b'\]"):
        load_state(bad, params, outer)
    assert torch.equal(params["w"], torch.zeros(4, 3))  # not half loaded
    extra = {**donor_state(params, outer), "model/extra": torch.zeros(1)}
    with pytest.raises(StateMismatch, match="unexpected"):
        load_state(extra, params, outer)


def test_a_non_finite_state_is_refused():
    params, outer = setup()
    bad = donor_state(params, outer)
    bad["outer/phi/w"][1, 1] = float("inf")
    with pytest.raises(StateMismatch, match="finite"):
        load_state(bad, params, outer)
    assert isinstance(StateMismatch("x"), ValueError)  # callers that catch ValueError keep working
