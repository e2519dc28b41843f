"""Async ops, deadlines, revoke, a killed peer, shrink, grow and split across
rank processes; the GIL, memory, fork() and bad input."""

import workers
from conftest import needs_torch


def test_async_ops_and_bounded_waits(two, store, name):
    timed_out = two.run(workers.async_ops, store.address, name)
    assert timed_out == [True, False]


def test_op_deadline(two, store, name):
    r0, r1 = two.run(workers.op_timeout, store.address, name)
    # A CommTimeoutError (under load it may also name rank 1 as failed:
    # its heartbeat, late, makes the error a peer failure too).
    assert r0["error"].startswith("CommTimeout"), r0
    assert r0["took"] < 5, r0  # the 0.5 s deadline, not the comm's 30 s
    assert r0["after"] != "ok" and r1["after"] != "ok"  # the comm stays broken on both ranks


def test_revoke_fails_pending_and_later_ops(two, store, name):
    r0, r1 = two.run(workers.revoke, store.address, name)
    assert r0 == "revoked"
    assert r1.startswith("revoked"), r1


def test_killed_peer_then_shrink_and_grow(three, store, name):
    """Rank 2 is SIGKILLed while ranks 0 and 1 wait in an all-reduce: both
    raise PeerFailedError naming it; they shrink to 2 ranks; a new process
    joins as rank 2 when they grow back to 3."""
    three.run(workers.start, store.address, name, 3)
    pend = [three.submit(r, workers.blocked_all_reduce, r, store.address, name) for r in (0, 1)]
    for r in (0, 1):
        store.get("%s/entering/%d" % (name, r), timeout=30)
    three.kill(2)
    for p in pend:
        kind, ranks, is_ft, msg = p.result(60)
        assert (kind, ranks, is_ft) == ("peer_failed", [2], True), msg
    got = three.run(workers.shrink_and_use, store.address, name, [2], ranks=[0, 1])
    assert [g[:4] for g in got] == [(0, 2, 1, 3), (1, 2, 1, 3)]
    prefix = got[0][4]
    three.restart(2)
    pend = [three.submit(r, workers.grow_and_use, r, store.address, name, 3) for r in (0, 1)]
    pend.append(three.submit(2, workers.join_and_use, 2, store.address, name, 3, 2, prefix))
    assert [p.result(60) for p in pend] == [(0, 3, 2, 6), (1, 3, 2, 6), (2, 3, 2, 6)]


def test_split(three, store, name):
    got = three.run(workers.split, store.address, name)
    assert got == [(0, 2, 4, 6), (0, 1, 2, 6), (1, 2, 4, 6)]


def test_other_threads_run_while_one_is_blocked(two, store, name):
    got = two.run(workers.thread_runs_while_blocked, store.address, name)
    assert got[0] == (200_000, True, True)


@needs_torch
def test_no_memory_growth_over_10000_ops(two, store, name):
    for grow, handles in two.run(workers.memory, store.address, name):
        assert handles == 0
        assert grow < 8 << 20, "RSS grew %d bytes over 10,000 ops" % grow


@needs_torch
def test_fork_child_is_refused_and_parent_goes_on(two, store, name):
    r0, r1 = two.run(workers.fork_child, store.address, name)
    assert r0["child"] == 0, "the forked child's call did not raise ForkError"
    assert r0["batches"] == 8
    assert r0["after"] == r1["after"] == 2.0


@needs_torch
def test_bad_input_raises_and_sends_nothing(two, store, name):
    for rank, got in enumerate(two.run(workers.bad_input, store.address, name)):
        after = got.pop("after")
        assert after == 3.0, "the comm did not survive the bad calls"
        types = {"complex dtype", "not a tensor", "bad op"}
        for what, res in got.items():
            if what.startswith("go: "):
                assert res == ("InvalidArgumentError", True), (what, res)
                continue
            want = ("TypeError" if what in types else "ValueError", True)
            assert res == want, (rank, what, res)
