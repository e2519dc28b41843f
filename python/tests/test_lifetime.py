"""Every op keeps its tensors alive until it completes, even when the
caller drops the Work (and the tensors) at once: the op's memory is never
freed while the op may still read or write it."""

import pytest

import lifetime
from conftest import needs_torch


@needs_torch
@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_dropped_works_keep_their_tensors(two, store, name, lib):
    bad = two.run(lifetime.dropped_works, store.address, name, lib=lib, timeout=300)
    assert bad == [[], []]


def test_dropped_works_then_finalize(two, store, name):
    live = two.run(lifetime.dropped_then_finalized, store.address, name)
    assert live == [0, 0]
