"""What the PyTorch examples share: the corpus (this repository's own text),
a small GPT, flat parameter buffers with an AdamW over them (so that a
replica's whole state is a few registered tensors), an SVG plotter, and the
launcher's view of replica processes."""

from __future__ import annotations

import json
import math
import os
import queue
import subprocess
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the corpus ----

def repo_root() -> str:
    return os.path.dirname(os.path.dirname(HERE))


def load_corpus(root: str, max_bytes: int = 2 << 20, val_frac: float = 0.1) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Go sources and Markdown of the repository at root, in path order,
    as bytes (a byte-level vocabulary of 256): train and validation parts."""
    chunks, n = [], 0
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x not in ("node_modules", "build"))
        for f in sorted(files):
            if f.endswith((".go", ".md")):
                with open(os.path.join(d, f), "rb") as fh:
                    b = fh.read()
                chunks.append(b)
                n += len(b)
        if n >= max_bytes:
            break
    data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 100_000:
        raise SystemExit("corpus at %s: only %d bytes of .go/.md text; pass --corpus" % (root, len(data)))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(t) * (1 - val_frac))
    return t[:cut], t[cut:]


def batch(data: torch.Tensor, gen: torch.Generator, batch: int, block: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + block + 1] for i in ix])
    return x.to(device), y.to(device)


# ---- the data, read through ftcomm's quorum-aware sampler ----

def sequences(data: torch.Tensor, block: int) -> int:
    """The samples of the training text: its windows of block bytes (and
    the byte after each, the last target), one after another."""
    return (len(data) - 1) // block


def sample_batch(data: torch.Tensor, indices: Sequence[int], block: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sequences of a micro-batch (a plan's indices): inputs and targets."""
    x = torch.stack([data[i * block:(i + 1) * block] for i in indices])
    y = torch.stack([data[i * block + 1:(i + 1) * block + 1] for i in indices])
    return x.to(device), y.to(device)


class Coverage:
    """What a job's committed steps read, as its replicas report it: each
    its slot of every step it committed (rank × group size + group rank,
    its indices, and the step's position and samples). The steps must
    follow one another from position 0, and no sample of an epoch may be
    read twice."""

    def __init__(self, size: int):
        self.size = size
        self.steps: Dict[int, dict] = {}

    def add(self, step: int, position: int, samples: int, slot: int, indices: Sequence[int]) -> None:
        st = self.steps.setdefault(step, {"position": position, "samples": samples, "slots": {}})
        if (st["position"], st["samples"]) != (position, samples):
            st["disagree"] = True
        st["slots"][slot] = list(indices)

    def summary(self) -> dict:
        """end (the position after the last step), epoch and in_epoch,
        steps, whole (steps every slot of which was reported), contiguous
        (no step missing, each starting where the one before ended),
        twice (samples read twice in an epoch: 0 for exactly once)."""
        pos, seen, twice, whole, contiguous = 0, set(), 0, 0, True
        for s in range(1, max(self.steps, default=0) + 1):
            st = self.steps.get(s)
            if st is None or st["position"] != pos or st.get("disagree"):
                contiguous = False
                if st is None:
                    continue
            read = [i for _, ids in sorted(st["slots"].items()) for i in ids]
            if len(read) == st["samples"]:  # every slot reported: the positions are known
                whole += 1
                for k, x in enumerate(read):
                    key = ((st["position"] + k) // self.size, x)
                    twice += key in seen
                    seen.add(key)
            pos = st["position"] + st["samples"]
        return {"end": pos, "epoch": pos // self.size, "in_epoch": pos % self.size, "size": self.size,
                "steps": len(self.steps), "whole": whole, "contiguous": contiguous, "twice": twice}

    @staticmethod
    def line(c: dict) -> str:
        once = "each exactly once" if c["twice"] == 0 and c["contiguous"] else "NOT exactly once (%d read twice%s)" % (
            c["twice"], "" if c["contiguous"] else ", steps missing or out of order")
        return "samples of the epoch covered by committed steps: %d of %d (epoch %d; %d in all), %s (%d of %d steps " \
               "with every slot reported)" % (c["in_epoch"], c["size"], c["epoch"], c["end"], once, c["whole"],
                                              c["steps"])


# ---- the model ----

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.x
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            a = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer over bytes."""

    def __init__(self, layers: int = 2, d: int = 128, heads: int = 4, block: int = 64, vocab: int = 256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, batch_size: int, block: int, device, batches: int = 8) -> float:
    g = torch.Generator().manual_seed(1234)  # the same batches at every evaluation
    tot = 0.0
    for _ in range(batches):
        x, y = batch(val, g, batch_size, block, device)
        tot += model(x, y).item()
    return tot / batches


# ---- flat state ----

class Flat:
    """The model's parameters as views into one buffer, their gradients into
    another: one all-reduce per step, and a replica's state is a few
    registered tensors. With multiple > 1 both buffers are padded with
    zeros to a multiple of it (n), so that they cut into that many equal
    shards; used counts the parameters."""

    def __init__(self, model: nn.Module, device, multiple: int = 1):
        ps = [p for p in model.parameters()]
        used = sum(p.numel() for p in ps)
        n = -(-used // multiple) * multiple
        self.params = torch.zeros(n, device=device)
        self.grads = torch.zeros(n, device=device)
        off = 0
        with torch.no_grad():
            for p in ps:
                k = p.numel()
                self.params[off:off + k].copy_(p.reshape(-1))
                p.data = self.params[off:off + k].view_as(p)
                p.grad = self.grads[off:off + k].view_as(p)
                off += k
        self.n, self.used = n, used


class AdamW:
    """AdamW over flat buffers, its state allocated up front (registrable)."""

    def __init__(self, n: int, device, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01):
        self.m = torch.zeros(n, device=device)
        self.v = torch.zeros(n, device=device)
        self.t = torch.zeros(1, dtype=torch.int64)  # steps taken (host)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay

    @torch.no_grad()
    def step(self, p: torch.Tensor, g: torch.Tensor, lr: Optional[float] = None) -> None:
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        t = int(self.t.item())
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.mul_(1 - lr * self.wd)
        denom = (self.v / (1 - b2 ** t)).sqrt_().add_(self.eps)
        p.addcdiv_(self.m, denom, value=-lr / (1 - b1 ** t))

    def reset(self) -> None:
        self.m.zero_()
        self.v.zero_()
        self.t.zero_()


def warm_spare(model: nn.Module, fully_shard, lr: float, batch: int, block: int) -> None:
    """What a spare does before it waits, on the GPU it will use: on a copy
    of its model sharded over this process alone (FSDP2's fully_shard on
    each block and the root), one forward and backward on a batch of zeros
    and one AdamW step over the DTensor shards. A spare's first iteration
    otherwise pays, after a death and inside the survivors' first
    full-size step, for DTensor's first dispatches (the first fully_shard
    of a process: 2.3 s on an H200 host) and the first CUDA kernels,
    cuBLAS and AdamW's first step (most of the survivors' 0.32 s wait in
    train_hsdp on 2x H200); its own sharding needs the place it takes,
    known only then. The copy is freed before the spare waits."""
    import copy

    from ftcomm.device_mesh import _make_mesh, _register_group
    from ftcomm.ft_torch import SoloProcessGroup

    name = "warm-%d" % os.getpid()
    _register_group(SoloProcessGroup(), name)
    mesh = _make_mesh("cuda", torch.arange(1, dtype=torch.int), (name,), 0)
    mesh._dim_group_names = [name]
    m = copy.deepcopy(model)
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    dev = next(model.parameters()).device
    x = torch.zeros(batch, block, dtype=torch.long, device=dev)
    m(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    del opt, m


def lr_at(step: int, total: int, peak: float, warmup: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))))


# ---- reporting ----

def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def svg_plot(path: str, series: Sequence[Tuple[str, Sequence[float], Sequence[float], str, bool]],
             vlines: Sequence[Tuple[float, str]] = (), title: str = "", xlabel: str = "", ylabel: str = "") -> None:
    """A line plot as SVG: series are (label, xs, ys, colour, dashed)."""
    W, H, L, R, T, B = 900, 520, 70, 20, 40, 60
    xs = [x for _, sx, _, _, _ in series for x in sx]
    ys = [y for _, _, sy, _, _ in series for y in sy]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or 0.1
    y0, y1 = y0 - pad, y1 + pad
    sx = lambda x: L + (x - x0) / ((x1 - x0) or 1) * (W - L - R)
    sy = lambda y: H - B - (y - y0) / ((y1 - y0) or 1) * (H - T - B)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (W, H),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="24" font-size="15">%s</text>' % (L, title)]
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        out.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (L, W - R, sy(y), sy(y)))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.2f</text>' % (L - 6, sy(y) + 4, y))
    for i in range(6):
        x = x0 + (x1 - x0) * i / 5
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (sx(x), H - B + 18, round(x)))
    out.append('<text x="%d" y="%d" text-anchor="middle">%s</text>' % ((L + W - R) // 2, H - 18, xlabel))
    out.append('<text x="16" y="%d" transform="rotate(-90 16 %d)" text-anchor="middle">%s</text>' % (H // 2, H // 2, ylabel))
    for x, label in vlines:
        out.append('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#c00" stroke-dasharray="4 3"/>' % (sx(x), sx(x), T, H - B))
        out.append('<text x="%.1f" y="%d" fill="#c00">%s</text>' % (sx(x) + 4, T + 14, label))
    for i, (label, xs_, ys_, colour, dashed) in enumerate(series):
        pts = " ".join("%.1f,%.1f" % (sx(x), sy(y)) for x, y in zip(xs_, ys_))
        out.append('<polyline fill="none" stroke="%s" stroke-width="1.6"%s points="%s"/>' % (
            colour, ' stroke-dasharray="6 4"' if dashed else "", pts))
        out.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"%s/>' % (
            W - 260, W - 230, T + 10 + 18 * i, T + 10 + 18 * i, colour, ' stroke-dasharray="6 4"' if dashed else ""))
        out.append('<text x="%d" y="%d">%s</text>' % (W - 224, T + 14 + 18 * i, label))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def ema(vals: Sequence[float], k: float = 0.9) -> List[float]:
    out, m = [], None
    for v in vals:
        m = v if m is None else k * m + (1 - k) * v
        out.append(m)
    return out


class Proc:
    """A replica process as the launcher sees it: JSON lines on its stdout."""

    def __init__(self, name: str, cmd: List[str], env: Dict[str, str], log: str):
        self.name = name
        self.log = open(log, "a")
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  text=True)
        self.q: "queue.Queue[Optional[dict]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            try:
                self.q.put(json.loads(line))
            except ValueError:
                self.log.write(line)
        self.q.put(None)

    def send(self, line: str) -> None:
        try:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()

    def close(self, timeout: float = 60) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()


def replica_env(extra: Dict[str, str]) -> Dict[str, str]:
    """The launcher's environment for a replica: it imports the same ftcomm."""
    import ftcomm
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ftcomm.__file__)))
    env["PYTHONPATH"] = pkg + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ---- capacity: what a kill costs the job ----

def capacity(recs: Sequence[dict], killed_at: float, full: int, survivors: Sequence[str], dead_gpus: int) -> dict:
    """What one kill at killed_at cost a job of full replica groups, from
    every rank's step records (dicts with who, committed, participants, t):

    - survivor_commit_s: kill → the survivors' first commit without the dead;
    - capacity_back_s: kill → the first step committed at full size again;
    - stall_s: each survivor rank's stall, kill → its first commit after it;
    - grow_stall_s: each survivor rank's wait in the grow that brought the
      job back to full size: its first step at full size took that much
      longer than its median step before the kill;
    - gpu_s_lost: the survivors' stalls (both) plus each of the dead group's
      dead_gpus GPUs missing until full size (GPU-seconds; one GPU a rank).
    Values are None where the run never got there."""
    after = [r for r in recs if r["committed"] and r["t"] > killed_at]
    shrunk = [r["t"] for r in after if r["participants"] < full]
    back = [r["t"] for r in after if r["participants"] >= full]
    out = {"survivor_commit_s": min(shrunk) - killed_at if shrunk else None,
           "capacity_back_s": min(back) - killed_at if back else None, "stall_s": {}, "grow_stall_s": {}}
    for w in survivors:
        mine = sorted(r["t"] for r in recs if r["committed"] and r["who"] == w)
        ts = [t for t in mine if t > killed_at]
        out["stall_s"][w] = ts[0] - killed_at if ts else None
        before = [b - a for a, b in zip(mine, mine[1:]) if b <= killed_at]
        full_t = [r["t"] for r in after if r["who"] == w and r["participants"] >= full]
        if before and full_t:
            prev = [t for t in mine if t < full_t[0]]
            step = sorted(before)[len(before) // 2]
            out["grow_stall_s"][w] = max(0.0, full_t[0] - prev[-1] - step) if prev else None
        else:
            out["grow_stall_s"][w] = None
    stalls = list(out["stall_s"].values()) + list(out["grow_stall_s"].values())
    if out["capacity_back_s"] is not None and all(v is not None for v in stalls):
        out["gpu_s_lost"] = sum(stalls) + dead_gpus * out["capacity_back_s"]
    else:
        out["gpu_s_lost"] = None
    return out


def timeline(rows: Sequence[Tuple[int, int]]) -> str:
    """Participants per committed step, as runs: "1-119: 2, 120: 1, 121-300: 2"."""
    out: List[str] = []
    start = prev = n = None
    for step, p in rows:
        if n is not None and p == n and step == prev + 1:
            prev = step
            continue
        if n is not None:
            out.append("%s: %d" % (str(start) if start == prev else "%d-%d" % (start, prev), n))
        start = prev = step
        n = p
    if n is not None:
        out.append("%s: %d" % (str(start) if start == prev else "%d-%d" % (start, prev), n))
    return ", ".join(out)


def fmt_s(v: Optional[float]) -> str:
    return "n/a" if v is None else "%.3f s" % v
