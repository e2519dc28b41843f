"""One replica of test_distributed_ft.py's FT-DDP job: a model in
ftcomm.ft_torch.ft_ddp, an OptimizerWrapper over Adam, register_state; a
training step per "step" line on stdin, one JSON line per step on stdout
(the state's digest: parameters and the optimizer's moments)."""

import hashlib
import json
import sys

import torch

import ftcomm
import ftcomm.ft
from ftcomm.ft_torch import OptimizerWrapper, ft_ddp, register_state

group = sys.argv[1]
rid = int(group[1:])
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial parameters on every replica
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
with ftcomm.ft.Comm(job="pytest-ft-ddp", group=group, min_replicas=1, timeout=10, lease_ttl=2, heartbeat=0.5,
                    log_level="error") as c:
    ddp = ft_ddp(model, c, bucket_cap_mb=0.001)  # small buckets: several ft all-reduces per step
    opt = OptimizerWrapper(c, torch.optim.Adam(ddp.parameters(), lr=0.01))
    names = register_state(c, ddp.module, opt)
    print(json.dumps({"ready": True, "registered": len(names)}), flush=True)

    def digest():
        h = hashlib.sha1()
        for n, p in ddp.module.named_parameters():
            h.update(p.detach().numpy().tobytes())
            for k, v in sorted(opt.state[p].items()):
                h.update(v.detach().numpy().tobytes())
        return h.hexdigest()[:12]

    for line in sys.stdin:
        if line.strip() != "step":
            break
        out = {}
        opt.zero_grad()
        out["pre"] = digest()
        s = c.committed_step
        g = torch.Generator().manual_seed(1000 * s + rid)
        ddp(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        ok = opt.step()
        out.update(committed=ok, step=c.committed_step, epoch=c.epoch, participants=c.participants, state=digest(), events=[e.kind for e in c.events()], rolled_back=opt.rolled_back)
        print(json.dumps(out), flush=True)
