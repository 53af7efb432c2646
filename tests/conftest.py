"""Shared fixtures: a tiny run spec and its corpus, loaded once per session."""

from __future__ import annotations

import os

# @triton.jit reads TRITON_INTERPRET when a kernel module is imported, which may be while any test module
# is collected (the codecs import their kernels): so it is set here, before all of them. Without a GPU the
# Triton kernels can only run interpreted; tests that need it unset unset it themselves.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from locomm.config import RunSpec


@pytest.fixture(scope="session")
def nano_spec() -> RunSpec:
    """The nano preset on a 2 MB slice of the standard library: seconds per test."""
    return RunSpec.preset("nano").replace("data", max_corpus_mb=2.0, batch_size=8, seq_len=64)


@pytest.fixture(scope="session")
def nano_splits(nano_spec):
    from locomm.data import load_corpus

    return load_corpus(nano_spec.data)
