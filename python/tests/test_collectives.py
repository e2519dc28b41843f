"""Every collective of the communicator, for each dtype, on torch tensors and
numpy arrays, against a host reference (gloo, 2 and 3 rank processes)."""

import workers
from conftest import needs_torch


@needs_torch
def test_every_collective_two_ranks(two, store, name):
    bad = two.run(workers.suite, store.address, name)
    assert bad == [[], []]


@needs_torch
def test_every_collective_three_ranks(three, store, name):
    bad = three.run(workers.suite, store.address, name, size=3, kinds=("torch",))
    assert bad == [[], [], []]
