"""A call refused on one rank (a bad argument there) makes the matching
call of every other rank fail at once with PeerRefusedError naming that
rank and its reason, and the communicator goes on: the next all-reduce and
messages carry the right values (gloo, 3 rank processes)."""

import refusal_workers as w
from conftest import needs_torch

# Far below the comm's deadline (30 s, workers.comm): a rank that waited for
# it, or that broke its comm, cannot pass.
WITHIN_S = 5.0

# Steps where the peer's op may have finished before the refusal reached
# it: a send hands its data to the transport and returns.
MAY_SUCCEED = {"recv into a non-contiguous tensor": {0}}


@needs_torch
def test_one_rank_refuses_and_the_others_fail_fast_and_go_on(three, store, name):
    outs = three.run(w.refused_ops, store.address, name, size=3)
    for i, step in enumerate(outs[0]):
        what, culprit = step["step"], step["culprit"]
        for rank in range(3):
            s = outs[rank][i]
            res = s["res"]
            if rank == culprit:
                assert res[0] in ("InvalidArgumentError", "InvalidTypeError"), (what, rank, res)
            elif res[0] != "idle" and not (res[0] == "ok" and rank in MAY_SUCCEED.get(what, ())):
                kind, who, op, reason, took, ranks, is_runtime = res
                assert kind == "PeerRefusedError", (what, rank, res)
                assert who == culprit and ranks == [culprit] and op and reason and is_runtime, (what, rank, res)
            assert res[0] == "idle" or res[-3 if res[0] == "PeerRefusedError" else -1] < WITHIN_S, (what, rank, res)
            assert s["error"] is None, (what, rank, s["error"])
            assert s["after"] == 6.0, (what, rank, s["after"])
            if rank in (1, 2):
                assert s["got"] == [float(v + i) for v in range(5)], (what, rank, s["got"])
