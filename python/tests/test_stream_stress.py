"""The randomized stress of stream_stress.py on CPU (2 rank processes):
ftcomm's gloo backend, through its Communicator and its torch.distributed
backend, gives exactly what torch's gloo gives for a seeded random sequence
of every op (sync and async, every completion, 0 to ~70K elements, layouts,
a comm finalized and made again now and then); and the harness reports a
wrong result with what replays it. On GPUs the same harness runs in
test_cuda.py and for minutes as python/tests/stream_stress.py."""

import os

from conftest import needs_torch

pytestmark = needs_torch

SEED = int(os.environ.get("FTCOMM_STRESS_SEED", "20261128"))


def test_random_ops_match_torch_gloo(two, tmp_path):
    import stream_stress
    res = two.run(stream_stress.rank_main, str(tmp_path / "store"), ops=200, seed=SEED, device="cpu", timeout=120)
    for (r,) in res:
        assert r["ops"] == 200 and r["checks"] > 500, stream_stress.describe(r)
        assert r["mismatches"] == 0, stream_stress.describe(r)
        assert len(r["kinds"]) == len(stream_stress.KINDS), stream_stress.describe(r)  # every kind ran


def test_a_wrong_result_is_reported_with_its_op(two, tmp_path):
    import stream_stress
    (r0,), (r1,) = two.run(stream_stress.rank_main, str(tmp_path / "store"), ops=40, seed=SEED, device="cpu",
                           inject="corrupt:17", timeout=120)
    assert r0["mismatches"] == 1 and r1["mismatches"] == 0, (stream_stress.describe(r0), stream_stress.describe(r1))
    first = r0["first"]
    assert first["op"] >= 17 and "seed %d: op %d:" % (SEED, first["op"]) in first["report"], first
    assert "CORRUPTED" in first["report"] and "first at flat index 0" in first["report"], first
