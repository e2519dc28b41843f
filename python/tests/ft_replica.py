"""One replica of test_ft.py's job: a step per "step" line on stdin, one
JSON line per step on stdout. A "fail" line is a step whose gradient is
NaN: the loop finds it before the all-reduce and fails the step
(fail_step), then issues the all-reduce anyway. FTCOMM_TEST_SPARE=1 makes
it a spare, FTCOMM_TEST_MIN_REPLICAS sets min_replicas (default 2)."""

import hashlib
import json
import os
import sys
import time

import torch

import ftcomm
import ftcomm.ft
from ftcomm import ReduceOp

group = sys.argv[1]
rid = int(group[1:])
params = torch.zeros(256, dtype=torch.float64)
spare = os.environ.get("FTCOMM_TEST_SPARE") == "1"
min_replicas = int(os.environ.get("FTCOMM_TEST_MIN_REPLICAS", "2"))
with ftcomm.ft.Comm(job="pytest-ft", group=group, min_replicas=min_replicas, timeout=10, lease_ttl=2, heartbeat=0.5,
                    log_level="error", spare=spare, host="host-" + group) as c:
    c.register("params", params)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd not in ("step", "fail"):
            break
        out = {}
        try:
            c.step()
        except ftcomm.RolledBackError as e:
            out["rolled_back"] = [e.from_step, e.to_step]
        s = c.committed_step
        grad = torch.full((256,), float(s + 1)) * (rid + 1)
        if cmd == "fail":
            grad[0] = float("nan")
            c.fail_step("loss is NaN")
            e = c.all_reduce(grad, ReduceOp.AVG).exception()  # revoked already: fails here
            out["after_fail_step"] = sorted(e.kinds) if e is not None else []
        else:
            c.all_reduce(grad, ReduceOp.AVG)
        ok = c.commit()
        if ok:
            params.add_(grad, alpha=0.01)
        out.update(committed=ok, step=c.committed_step, epoch=c.epoch, participants=c.participants, t=time.time(),
                   state=hashlib.sha1(params.numpy().tobytes()).hexdigest()[:12], finite=bool(params.isfinite().all()),
                   events=[e.kind for e in c.events()], spare=c.spare)
        print(json.dumps(out), flush=True)
