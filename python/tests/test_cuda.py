"""The CUDA (nccl) path on 2 GPUs: every collective and dtype against a host
reference, ordering with PyTorch's streams, async ops, a deadline, memory.
Skipped without torch and 2 CUDA devices (CI); run on the GPU machines."""

import workers
from conftest import needs_cuda


@needs_cuda
def test_cuda_every_collective(two, store, name):
    res = two.run(workers.cuda_suite, store.address, name, timeout=300)
    for bad, info in res:
        assert bad == []
        # Which NCCL, why, and the fault path its version allows.
        assert info["loaded"] and info["nccl_path"] and info["nccl_source"], info
        assert any(c["path"] == info["nccl_path"] for c in info["candidates"]) or info["nccl_source"] in ("config", "env"), info
        assert info["recovery"] in ("fresh-init", "shrink-abort", "revoke+shrink"), info
    print("NCCL used:", res[0][1])


@needs_cuda
def test_cuda_stream_order(two, store, name):
    for r in two.run(workers.cuda_stream_order, store.address, name):
        assert r["x"] == 3 and r["y"] == 6, r
        assert r["z"] == 2 and r["async"] == 3, r
        assert r["stream_busy_after_call"], r  # the call returned while the stream still worked
        print(r)


@needs_cuda
def test_cuda_deadline(two, store, name):
    r0, _ = two.run(workers.cuda_timeout, store.address, name)
    assert r0["call_s"] < 1, r0
    assert r0["stream_free_s"] < 20, r0
    assert r0["next"] == "CommTimeoutError" and r0["timeout"], r0
    print(r0)


@needs_cuda
def test_cuda_no_memory_growth(two, store, name):
    for grow, handles, per_op in two.run(workers.cuda_memory, store.address, name):
        assert handles == 0
        assert grow < 16 << 20, grow
        print("RSS growth %d bytes, %.1f µs per 4 KiB all-reduce" % (grow, per_op * 1e6))


@needs_cuda
def test_cuda_async_list_op_copy_is_ordered_on_its_stream(two, store, name):
    # An async all_gather/all_to_all into outputs that are not one buffer,
    # seen to end by the next op on another, busy stream: the copy into the
    # outputs goes to the issuing stream, wait() or is_completed() under a
    # third stream orders that stream after it, and the scratch buffer is
    # not reused on its stream before the copy has read it.
    for r in two.run(workers.cuda_list_copy_order, store.address, name, timeout=300):
        for key, v in r.items():
            assert v["read"] == v["want"], (key, v)
            assert v["final"] == v["want"], (key, v)
        print(r)


# torchcomms' API on NCCL (test_torchcomms_api.py runs the same on gloo).

@needs_cuda
def test_cuda_zero_element_tensors(two, store, name):
    import api_workers
    for failed, after in two.run(api_workers.zero_elements, store.address, name, backend="nccl"):
        assert failed == []
        assert after == 3.0


@needs_cuda
def test_cuda_finalize_after_sync_op(two, store, name):
    # finalize right after a sync op (which returns once enqueued on CUDA)
    # while the peer is late: the op completes, its sum is right.
    import api_workers
    for got in two.run(api_workers.finalize_after_sync_op, store.address, name, backend="nccl"):
        assert got == [3.0] * 3, got
    # The peer a second late: long after an abort would have cancelled the op.
    for got in two.run(api_workers.finalize_after_sync_op, store.address, name + "-late", backend="nccl", rounds=1,
                       late=1.0, timeout=60):
        assert got == [3.0], got


@needs_cuda
def test_cuda_reductions(two, store, name):
    import api_workers
    assert two.run(api_workers.reductions, store.address, name, backend="nccl", timeout=300) == [{}, {}]


@needs_cuda
def test_cuda_v_and_list_ops(two, store, name):
    import api_workers
    assert two.run(api_workers.v_and_list_ops, store.address, name, backend="nccl", timeout=300) == [{}, {}]


@needs_cuda
def test_cuda_batched_send_recv(two, store, name):
    import api_workers
    for rank, (got, empty) in enumerate(two.run(api_workers.batch_p2p, store.address, name, backend="nccl")):
        assert got == [([float(1 - rank)] * 3, [(1 - rank) * 10] * 5, 4)] * 2
        assert empty == "InvalidArgumentError"


@needs_cuda
def test_cuda_dropped_works_keep_their_tensors(two, store, name):
    import lifetime
    assert two.run(lifetime.dropped_works, store.address, name, lib="torch", device="cuda", rounds=2,
                   timeout=300) == [[], []]


# The randomized stream-order stress (stream_stress.py; for minutes:
# python3 python/tests/stream_stress.py --ops 10000 --runs 5).

@needs_cuda
def test_cuda_stream_order_stress(two, tmp_path):
    # Every op of the Communicator and of the torch.distributed backend,
    # sync and async, on the current and side streams behind busy kernels,
    # with kernels reading and changing the results right after: bit for
    # bit what torch's NCCL gives. A fresh seed each time unless
    # FTCOMM_STRESS_SEED is set; a failure names it.
    import stream_stress
    seed = stream_stress.seed_from_env()
    res = two.run(stream_stress.rank_main, str(tmp_path / "store"), ops=1500, seed=seed, device="cuda", timeout=600)
    for (r,) in res:
        print(stream_stress.describe(r))
        assert r["ops"] == 1500 and r["mismatches"] == 0, stream_stress.describe(r)


@needs_cuda
def test_cuda_stress_catches_a_missing_stream_dependency(two, tmp_path):
    # The harness's own check: ops issued from a stream that did not wait
    # for the kernels writing their inputs must show as mismatches.
    import stream_stress
    res = two.run(stream_stress.rank_main, str(tmp_path / "store"), ops=40, seed=1, device="cuda",
                  inject="unordered", kinds=["all_reduce", "broadcast", "all_gather_single"], finalize_every=0,
                  timeout=300)
    assert sum(r["mismatches"] for (r,) in res) > 0, [stream_stress.describe(r) for (r,) in res]
