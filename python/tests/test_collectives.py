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


@needs_torch
def test_all_to_all_single_not_divisible_by_the_ranks(three, store, name):
    # 7 elements on 3 ranks: a clear InvalidArgumentError on every rank,
    # at once (never a hang), and the comm runs the next op.
    res = three.run(workers.indivisible_all_to_all, store.address, name, timeout=60)
    for rank, got in enumerate(res):
        assert got.pop("slowest_s") < 1, got
        want_after = [float(10 * r + 3 * rank + k) for r in range(3) for k in range(3)]
        assert got == {"sync": "InvalidArgumentError", "async": "InvalidArgumentError",
                       "numpy": "InvalidArgumentError", "v with equal splits": "InvalidArgumentError",
                       "go": "InvalidArgumentError", "after": want_after}, (rank, got)
