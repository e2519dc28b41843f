"""One replica of test_data.py's job: a quorum-aware Sampler and a
register_stateful object, a step per "step" line on stdin ("step fail":
refuse the step's all-reduce, so that the step fails at every replica), one
JSON line per step on stdout, flushed: what the step read (the plan), its
rank, whether it committed, the stateful object's state and the model's.
FTCOMM_TEST_JOB names the job, FTCOMM_TEST_SIZE the dataset's size."""

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
size = int(os.environ["FTCOMM_TEST_SIZE"])


class Progress:
    """A job-global stateful object: where the job's committed steps got to
    (advanced from each step's plan, as a StatefulDataLoader advances)."""

    def __init__(self):
        self.steps, self.position, self.digest = 0, 0, ""

    def advance(self, plan):
        self.steps += 1
        self.position = plan.position + plan.samples
        self.digest = hashlib.sha1(("%s|%d:%d:%d" % (self.digest, plan.step, plan.position, plan.samples)).encode()
                                   ).hexdigest()[:16]

    def state_dict(self):
        return {"steps": self.steps, "position": self.position, "digest": self.digest}

    def load_state_dict(self, sd):
        self.steps, self.position, self.digest = sd["steps"], sd["position"], sd["digest"]


params = torch.zeros(64, dtype=torch.float64)
with ftcomm.ft.Comm(job=os.environ["FTCOMM_TEST_JOB"], group=group, min_replicas=2, timeout=10, lease_ttl=2,
                    heartbeat=0.5, log_level="error") as c:
    c.register("params", params)
    sampler = ftcomm.ft.Sampler(c, size=size, batch=4, accum=2, seed=7)
    progress = Progress()
    state = ftcomm.ft.register_stateful(c, "progress", progress, capacity=1024)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "step":
            break
        out = {}
        try:
            c.step()
        except ftcomm.RolledBackError as e:
            out["rolled_back"] = [e.from_step, e.to_step]
        try:
            plan = sampler.plan()
        except ftcomm.NotParticipatingError:
            plan = None
        rank = c.rank
        grad = torch.zeros(64, dtype=torch.float64)
        if plan is not None:
            for m in plan.micro:
                for i in m.indices:
                    grad[i % 64] += m.weight
            progress.advance(plan)
        if "fail" in cmd:
            try:  # in the all-reduce's place: the peers' all-reduce is refused
                c.all_reduce(torch.zeros(1, dtype=torch.bool), ReduceOp.AVG)
            except ftcomm.InvalidArgumentError:
                out["refused"] = True
        else:
            c.all_reduce(grad, ReduceOp.SUM)
        ok = c.commit()
        if ok:
            params.add_(grad, alpha=0.01)
        if plan is not None:
            out["plan"] = {"step": plan.step, "position": plan.position, "epoch": plan.epoch,
                           "samples": plan.samples, "participants": plan.participants, "target": plan.target,
                           "policy": plan.policy, "lr_scale": plan.lr_scale,
                           "micro": [m.indices for m in plan.micro], "weights": [m.weight for m in plan.micro]}
        out.update(group=group, committed=ok, step=c.committed_step, rank=rank, participants=c.participants,
                   position=sampler.position, progress=progress.state_dict(), loads=state.loads, t=time.time(),
                   state=hashlib.sha1(params.numpy().tobytes()).hexdigest()[:12],
                   events=[e.kind for e in c.events()])
        print(json.dumps(out), flush=True)
