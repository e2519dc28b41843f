"""The "ftcomm" torch.distributed backend on 2 GPUs (torch 2.x with CUDA;
skipped elsewhere): every op FSDP, DDP and DTensor call equal to torch's
NCCL backend, torch's stream order, DDP and FSDP (1) the same as over
torch's NCCL, FSDP2 and DTensor over ftcomm.device_mesh, a PREMUL_SUM built
by torch on every reduction and FSDP2's gradient divide factor as torch's
NCCL computes them. Run with python/tests/gpu_distributed.sh."""

import warnings

import pytest

from conftest import needs_cuda

pytestmark = needs_cuda


def _has_fsdp2():
    try:
        import torch.distributed.device_mesh  # noqa: F401
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def group(two, tmp_path_factory):
    import dist_cuda_workers
    path = str(tmp_path_factory.mktemp("dist") / "store")
    got = two.run(dist_cuda_workers.init, path, timeout=180)
    assert got[0][0] == "ftcomm"
    yield two
    two.run(dist_cuda_workers.shutdown, timeout=120)


def test_cuda_ops_match_torch_nccl(group):
    import dist_cuda_workers
    assert group.run(dist_cuda_workers.ops, timeout=180) == [[], []]


def test_cuda_stream_order_as_torch_nccl(group):
    import dist_cuda_workers
    assert group.run(dist_cuda_workers.stream_order, timeout=120) == [True, True]


def test_cuda_ddp_same_as_torch_nccl(group):
    import dist_cuda_workers
    for d in group.run(dist_cuda_workers.ddp, timeout=180):
        assert d < 1e-5, d


def test_cuda_fsdp1_same_as_torch_nccl(group):
    import dist_cuda_workers
    for d in group.run(dist_cuda_workers.fsdp1, timeout=180):
        assert d < 1e-4, d


@pytest.mark.skipif(not _has_fsdp2(), reason="needs torch with DeviceMesh and FSDP2")
def test_cuda_fsdp2_and_dtensor_over_device_mesh(group, store):
    import dist_cuda_workers
    try:
        got = group.run(dist_cuda_workers.fsdp2_device_mesh, store.address, timeout=240)
    finally:
        group.run(dist_cuda_workers.finalize_fsdp2, timeout=60)
    for loss_diff, dtensor_ok in got:
        assert loss_diff < 1e-4 and dtensor_ok, got


def test_cuda_premul_sum_from_torch_matches_torch_nccl(group):
    """A PREMUL_SUM built by torch (scalar and tensor factors of the data's
    dtype) on every reduction, four float dtypes: with factors that are
    powers of two equal to torch's NCCL bit for bit; with 1/3 equal to
    NCCL's PreMulSum formula bit for bit and within 1 ulp of NCCL's own
    result (its kernel may fuse a product into the sum: such results are
    named in a warning). A tensor factor is never read by the host, and
    one of another dtype is refused. bfloat16 on a torch whose NCCL
    misreads the factor (pytorch/pytorch#190745): against NCCL's PreMulSum
    arithmetic run on torch's NCCL, bit for bit (a warning says so)."""
    import dist_cuda_workers
    got = group.run(dist_cuda_workers.premul_ops, timeout=180)
    bad = ["rank %d: %s" % (r, b) for r, (bs, _, _) in enumerate(got) for b in bs]
    assert not bad, "\n".join(bad)
    for note in sorted({n for _, _, ns in got for n in ns}):
        warnings.warn(note)
    near = sorted({n for _, ns, _ in got for n in ns})
    if near:
        warnings.warn("PREMUL_SUM by 1/3: %d results differ from torch's NCCL by 1 ulp (NCCL fuses the multiply "
                      "into the sum): %s" % (len(near), ", ".join(near)))


@pytest.mark.skipif(not _has_fsdp2(), reason="needs torch with DeviceMesh and FSDP2")
def test_cuda_fsdp2_gradient_divide_factor_as_torch_nccl(group, store):
    """FSDP2 over ftcomm.device_mesh with set_gradient_divide_factor(f), f in
    1, 2 (the world size: AVG), 3, 4, in float32 and with bfloat16
    reduction (f = 3, 4), and with set_force_sum_reduction_for_comms(True):
    the local gradient shards after backward equal those over torch's NCCL,
    bit for bit where each product is exact, within the bound of one fused
    multiply-add otherwise (see fsdp2_divide_factor). bfloat16 on a torch
    whose NCCL misreads a bfloat16 PREMUL_SUM's factor (pytorch/pytorch#190745:
    its gradients are zeros or ~1e-13 of the right ones): against FSDP2 over
    torch's NCCL with that reduce-scatter run as NCCL's kernel computes it,
    bit for bit (a warning says so). Every failing case is reported."""
    import dist_cuda_workers
    try:
        got = group.run(dist_cuda_workers.fsdp2_divide_factor, store.address, timeout=240)
    finally:
        group.run(dist_cuda_workers.finalize_fsdp2, timeout=60)
    ran = [case for case, res in got[0].items() if not isinstance(res, str) or res.startswith("error")]
    if not ran:
        pytest.skip("this torch's FSDP2 has no gradient divide factor: %s" % got[0])
    failures, notes = [], set()
    for rank, per_rank in enumerate(got):
        for case in ran:
            res = per_rank[case]
            if isinstance(res, str):
                failures.append("rank %d, %s: %s" % (rank, case, res))
                continue
            if res["ref"] != "FSDP2 over torch's NCCL":
                notes.add("%s: the reference is %s" % (case, res["ref"]))
            for i, (diff, tol, mine, ref) in enumerate(res["params"]):
                if not diff <= tol:
                    failures.append("rank %d, %s, parameter %d: max |ftcomm - ref| %.6g > %.6g (max |ftcomm| %.6g, "
                                    "max |ref| %.6g; ref: %s)" % (rank, case, i, diff, tol, mine, ref, res["ref"]))
    for note in sorted(notes):
        warnings.warn(note)
    assert not failures, "%d failures:\n%s" % (len(failures), "\n".join(failures))
