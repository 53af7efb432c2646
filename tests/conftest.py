"""Shared fixtures: a tiny run spec and its corpus, loaded once per session."""

from __future__ import annotations

import pytest

from locomm.config import RunSpec


@pytest.fixture(scope="session")
def nano_spec() -> RunSpec:
    """The nano preset on a 2 MB slice of the standard library: seconds per test."""
    return RunSpec.preset("nano").replace("data", max_corpus_mb=2.0, batch_size=8, seq_len=64)


@pytest.fixture(scope="session")
def nano_splits(nano_spec):
    from locomm.data import load_corpus

    return load_corpus(nano_spec.data)
