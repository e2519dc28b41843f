"""torch.distributed over the "ftcomm" backend (ftcomm.distributed) on CPU
tensors, in rank processes: every op DDP and FSDP call gives what torch's
own gloo backend gives on the same inputs; DDP trains to the same gradients
and parameters; a killed rank fails its peers' collective with a torch
distributed error that names it, well within the group's deadline.

(FSDP itself needs CUDA on torch 1.13: test_cuda_distributed.py runs it on
GPUs; the ops it calls — all-gather and reduce-scatter into and out of flat
tensors, all-reduce, broadcast — are tested here.)"""

import pytest

from conftest import needs_torch

pytestmark = needs_torch


@pytest.fixture(scope="module")
def group(two, tmp_path_factory):
    import dist_workers
    path = str(tmp_path_factory.mktemp("dist") / "store")
    got = two.run(dist_workers.init, path, timeout=120)
    assert got == [("ftcomm", "ProcessGroupFtcomm")] * 2
    yield two, path


def test_every_op_matches_torch_gloo(group):
    import dist_workers
    two, _ = group
    assert two.run(dist_workers.ops) == [[], []]


def test_ddp_same_gradients_as_torch_gloo(group):
    """Same seed, same batches, parameters started apart (DDP's broadcast
    aligns them): every gradient and parameter equal after 3 steps, with
    small buckets so that several all-reduces are in flight."""
    import dist_workers
    two, _ = group
    assert two.run(dist_workers.ddp_grads) == [0.0, 0.0]


def test_ddp_comm_hook_chains_on_futures(group):
    import dist_workers
    two, _ = group
    assert two.run(dist_workers.ddp_comm_hook) == [0.0, 0.0]


def test_refused_call_fails_the_peer_fast_and_the_group_goes_on(group):
    """A call one rank refuses (a bad argument there, found by torch's
    layer of ftcomm or by the communicator) fails the other rank's matching
    call at once with a DistBackendError that is PeerRefusedError naming
    the refusing rank, and the next all-reduce runs on both."""
    import dist_workers
    two, _ = group
    outs = two.run(dist_workers.refused)
    for i, step in enumerate(outs[0]):
        for rank in range(2):
            s = outs[rank][i]
            res = s["res"]
            if rank == step["culprit"]:
                assert res["kind"] == "InvalidArgumentError", (s, rank)
            else:
                assert res["kind"] == "PeerRefusedError" and res["dist"], (s, rank)
                assert res["rank"] == step["culprit"] and res["ranks"] == [step["culprit"]] and res["reason"], (s, rank)
            assert res["took"] < 5, (s, rank)  # the group's deadline is 20 s
            assert s["after"] == 3.0, (s, rank)


def test_killed_rank_raises_a_dist_error_naming_it(group, store, name):
    """Rank 1 is SIGKILLed while rank 0 waits in an all-reduce: rank 0's
    all_reduce raises DistBackendError (also ftcomm's PeerFailedError) whose
    message and .ranks name rank 1, long before the group's 20 s deadline."""
    import dist_workers
    two, path = group
    pend = two.submit(0, dist_workers.blocked_all_reduce, 0, store.address, name)
    store.get(name, timeout=60)
    two.kill(1)
    r = pend.result(60)
    assert not r["ok"] and r["dist"] and r["peer_failed"], r
    assert r["ranks"] == [1] and "rank 1" in r["msg"], r
    assert r["took"] < 10, r
    two.restart(1)
    two.run(dist_workers.shutdown, ranks=[0])


def test_dist_errors_pickle():
    """A CUDA Future pickles an exception set on it (to look for tensors):
    DDP's comm hooks failed with "Can't pickle <class
    'ftcomm.distributed.PeerFailedError'>". Each ftcomm error made a torch
    distributed error is kept in ftcomm.distributed, so it pickles."""
    import pickle

    import ftcomm.distributed as fd
    from ftcomm.errors import CommTimeoutError, PeerFailedError
    for err in (PeerFailedError("comm x: peer failed", kinds=("peer_failed",), ranks=(1,)),
                CommTimeoutError("comm x: timeout", kinds=("timeout",))):
        e = fd.dist_error(err)
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e)
        assert isinstance(back, fd.DistBackendError) and isinstance(back, type(err))
        assert back.ranks == err.ranks and back.kinds == err.kinds and str(back) == str(e)
