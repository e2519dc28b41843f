"""torch.distributed over the "ftcomm" backend (ftcomm.distributed) on CPU
tensors, in rank processes: every op DDP and FSDP call gives what torch's
own gloo backend gives on the same inputs; DDP trains to the same gradients
and parameters; a killed rank fails its peers' collective with a torch
distributed error that names it, well within the group's deadline; a
PREMUL_SUM built by torch (FSDP2's gradient divide factor) works on every
reduction where torch shows its factor, and is refused clearly where it
does not (torch 1.13).

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


def test_premul_sum_from_torch_on_every_reduction(group):
    """Every reduction of the group with a PREMUL_SUM built by torch (on
    torch 1.13, whose op hides its factor, an op that pickles as torch 2's
    does), scalar and tensor factors, four float dtypes: the sum of each
    rank's input times the factor, bit for bit."""
    import dist_workers
    two, _ = group
    assert two.run(dist_workers.premul) == [[], []]


def test_premul_sum_factor_of_another_dtype_is_refused(group):
    """A PREMUL_SUM whose tensor factor is not of the data's dtype (float32
    for bfloat16 data, as torch's NCCL up to 2.11 wants it, float64 for
    float32, ...) or not one element, on every reduction of the group:
    refused on every rank before anything is issued (a coalesced call
    included), with a DistBackendError that is an InvalidArgumentError
    naming both dtypes, the tensors untouched, the group usable after."""
    import dist_workers
    two, _ = group
    assert two.run(dist_workers.premul_factor_dtype_refused) == [[], []]


def test_premul_sum_from_torch_1_13_is_refused_on_every_rank(group):
    """torch 1.13's PREMUL_SUM cannot show its factor: every rank gets a
    DistBackendError that is an InvalidArgumentError naming the cause and
    the ways out, its tensor untouched, and the group still reduces."""
    import dist_workers
    if dist_workers.TORCH_OPS_PICKLE:
        pytest.skip("this torch shows a PREMUL_SUM's factor (test_premul_sum_from_torch_on_every_reduction)")
    two, _ = group
    for got in two.run(dist_workers.premul_refused):
        assert not got["ok"] and got["dist"] and got["invalid"], got
        assert "upgrade torch" in got["msg"] and "set_force_sum_reduction_for_comms(True)" in got["msg"], got
        assert got["untouched"] and got["sum_after"], got


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
    """Every ftcomm error made a torch distributed error pickles (a CUDA
    Future pickles an exception set on it, to look for tensors, as DDP's
    comm hooks' futures are): its class is kept in the module it names
    (ftcomm._dist_errors), and comes back the same class, message, kinds
    and ranks."""
    import pickle

    import ftcomm.distributed as fd
    from ftcomm._dist_errors import dist_error
    from ftcomm.errors import CommTimeoutError, PeerFailedError
    for err in (PeerFailedError("comm x: peer failed", kinds=("peer_failed",), ranks=(1,)),
                CommTimeoutError("comm x: timeout", kinds=("timeout",))):
        e = dist_error(err)
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e)
        assert isinstance(back, fd.DistBackendError) and isinstance(back, type(err))
        assert back.ranks == err.ranks and back.kinds == err.kinds and str(back) == str(e)


def test_reduce_op_decoding():
    """torch's ops become ftcomm's: each kind by its type, a PREMUL_SUM with
    the factor of its pickled state (a number, or the tensor itself, never
    read on the host), two PREMUL_SUMs that torch would call equal keep
    their own factors; torch's ops on this torch (1.13: a PREMUL_SUM is
    refused, naming the fix)."""
    import torch
    import torch.distributed as dist

    import dist_workers
    import ftcomm
    from dist_workers import StateOp
    from ftcomm._dist_reduce_ops import from_torch
    from ftcomm import RedOpType, ReduceOp

    R = dist.ReduceOp
    assert from_torch(None) is ReduceOp.SUM
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        assert from_torch(getattr(R, name)) is getattr(ReduceOp, name)
        assert from_torch(getattr(R.RedOpType, name)) is getattr(ReduceOp, name)
        assert from_torch(StateOp(None, getattr(R.RedOpType, name))) is getattr(ReduceOp, name)
    assert from_torch(dist.AllreduceOptions().reduceOp) is ReduceOp.SUM

    a, b = from_torch(StateOp(2.0)), from_torch(StateOp(0.5))
    assert (a.type, a.factor, b.type, b.factor) == (RedOpType.PREMUL_SUM, 2.0, RedOpType.PREMUL_SUM, 0.5)
    assert from_torch(StateOp(3)).factor == 3.0
    f = torch.tensor([0.25])
    assert from_torch(StateOp(f)).factor is f
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([2]), "2", None, True):
        with pytest.raises(ftcomm.InvalidArgumentError, match="PREMUL_SUM factor"):
            from_torch(StateOp(bad))

    real = dist._make_nccl_premul_sum(2.0)
    if dist_workers.TORCH_OPS_PICKLE:
        assert from_torch(real).factor == 2.0
        t = from_torch(dist._make_nccl_premul_sum(torch.tensor(0.5))).factor
        assert isinstance(t, torch.Tensor) and float(t) == 0.5
    else:
        with pytest.raises(ftcomm.InvalidArgumentError) as e:
            from_torch(real)
        msg = str(e.value)
        assert "PREMUL_SUM made by torch " + torch.__version__ in msg, msg
        assert "upgrade torch" in msg and "set_force_sum_reduction_for_comms(True)" in msg, msg
