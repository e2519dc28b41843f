"""The "ftcomm" torch.distributed backend on 2 GPUs (torch 2.x with CUDA;
skipped elsewhere): every op FSDP, DDP and DTensor call equal to torch's
NCCL backend, torch's stream order, DDP and FSDP (1) the same as over
torch's NCCL, FSDP2 and DTensor over ftcomm.device_mesh. Run with
python/tests/gpu_distributed.sh."""

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
