"""Fault-tolerant data parallelism for torch modules, through ftcomm.ft.Comm.

Three pieces, each usable alone:

- :func:`register_state` — one call that registers a module's parameters
  and buffers and an optimizer's state (made now, as zeros) with an
  ft.Comm, so that a returning replica heals them from its peers. Sharded
  parameters (FSDP2's DTensors) register their local shard: with replica
  groups, shard rank i heals from shard rank i of a live group.
  :func:`protect_shards` is its form for a group with no replica (FSDP over
  every rank, ft.Comm's ``snapshot_every``): it registers a rank's shards,
  optimizer state, data position and extra tensors for its peer
  snapshots, and refuses a Comm that takes none.
- :class:`OptimizerWrapper` — ``zero_grad()`` starts the ft step (quorum,
  reconfiguration, healing), ``step()`` commits it and steps the optimizer
  only if the step committed.
- the data-parallel collectives through ft.Comm:

  - FT-DDP: :func:`ft_ddp` wraps a module in torch's DistributedDataParallel
    whose gradient buckets are averaged across replicas by ft.Comm (a comm
    hook); DDP's own group is this process alone. One process per replica.
  - FT-HSDP (torch >= 2.6, FSDP2): :func:`hsdp_all_reduce_hook` gives
    ``fully_shard``'s all-reduce hook: the reduce-scattered gradient shard
    is averaged across the replica groups by ft.Comm (FT comm i joins
    shard rank i of every group); the shard dimension runs on the group's
    own process group (ftcomm.device_mesh, or any).

A failure in a collective is recorded by ft.Comm, not raised; the step's
commit says whether it counts::

    c = ftcomm.ft.Comm(job="j", group="r0", ...)
    model = ft_ddp(model, c)
    opt = OptimizerWrapper(c, torch.optim.AdamW(model.parameters()))
    register_state(c, model, opt)
    while c.committed_step < steps:
        opt.zero_grad()                   # ft step: quorum, heal if behind
        model(batch(c.committed_step)).backward()
        opt.step()                        # commit; optimizer step if committed
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .data import register_stateful
from .errors import (FinishedError, FtcommError, InvalidArgumentError, InvalidTypeError, NotParticipatingError,
                     RolledBackError)
from .reduce_op import ReduceOp

__all__ = ["register_state", "protect_shards", "OptimizerWrapper", "ft_ddp", "ddp_comm_hook", "hsdp_all_reduce_hook",
           "SoloProcessGroup", "local_tensor"]


# ---------------------------------------------------------------- state

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The memory of t that this rank holds: a DTensor's local shard (a
    view of FSDP2's sharded storage), else t's data."""
    lt = getattr(t, "_local_tensor", None)
    if lt is not None:
        return lt.detach()
    if hasattr(t, "to_local"):
        return t.to_local().detach()
    return t.detach()


def _materialize(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's per-parameter state now, as a fresh state:
    one step with zero gradients, then the parameters put back and every
    state tensor zeroed (for Adam, AdamW, SGD with momentum, ...: the state
    of an optimizer that has not stepped). The tensors made here are the
    ones the optimizer updates in place from then on."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(len(optimizer.state.get(p, {})) > 0 for p in params):
        return
    saved = []
    with torch.no_grad():
        for p in params:
            saved.append((p, p.detach().clone(), p.grad))
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()


def register_state(comm, module: Optional[torch.nn.Module] = None, optimizer: Optional[Any] = None,
                   prefix: str = "") -> List[str]:
    """Register module's parameters and buffers and optimizer's state with
    an ftcomm.ft.Comm (before its first step), as what a healing replica
    receives. Returns the names registered, in order.

    The optimizer (a torch optimizer, or an OptimizerWrapper) gets its state
    made now (see _materialize). Every tensor is registered as its local
    memory (a DTensor's shard); empty shards are skipped. Every replica (and
    the same shard rank of every replica group) registers the same names in
    the same order: build the model and optimizer the same way everywhere.
    State that is not a tensor (a Python number in an optimizer's state) is
    refused: it cannot be healed.
    """
    names: List[str] = []

    def reg(name: str, t: torch.Tensor) -> None:
        lt = local_tensor(t)
        if lt.numel() == 0:
            return
        if not lt.is_contiguous():
            raise FtcommError("ftcomm: register_state: %s is not contiguous: its memory cannot be healed in place" % name,
                              kinds=("invalid_argument",))
        comm.register(prefix + name, lt)
        names.append(prefix + name)

    fqn: Dict[int, str] = {}
    if module is not None:
        for n, p in module.named_parameters():
            fqn[id(p)] = n
            reg("param/" + n, p)
        for n, b in module.named_buffers():
            if b is not None:
                reg("buffer/" + n, b)
    if optimizer is not None:
        opt = getattr(optimizer, "optim", optimizer)
        _materialize(opt)
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                st = opt.state.get(p)
                if not st:
                    continue
                pname = fqn.get(id(p), "group%d.%d" % (gi, pi))
                for k, v in sorted(st.items()):
                    if isinstance(v, torch.Tensor):
                        reg("optim/%s/%s" % (pname, k), v)
                    elif v is not None:
                        raise FtcommError("ftcomm: register_state: the optimizer's state %r of %s is a %s, not a "
                                          "tensor: it cannot be healed" % (k, pname, type(v).__name__),
                                          kinds=("invalid_argument",))
    return names


def protect_shards(comm, module: Optional[torch.nn.Module] = None, optimizer: Optional[Any] = None, *,
                   stateful: Optional[Dict[str, Any]] = None,
                   tensors: Optional[Dict[str, torch.Tensor]] = None) -> List[str]:
    """Register everything a rank of a replica group with no replica holds
    with its ftcomm.ft.Comm (before its first step), so that the group's
    peer snapshots (``snapshot_every``) carry it: when the rank dies, its
    replacement (a slot spare, or its restarted process) restores it from
    the buddy's copy and the other ranks roll back to the same step.
    Returns the names registered, in order.

    - module and optimizer: register_state's — the module's parameters and
      buffers as this rank's local shards (FSDP2's DTensors), the
      optimizer's state made now;
    - stateful: name -> an object with ``state_dict()`` and
      ``load_state_dict()`` (a data loader's reader, an RNG), each through
      register_stateful with its default capacity (loaded back after a
      restore; call register_stateful for another capacity);
      ftcomm.ft.Sampler registers its position itself;
    - tensors: name -> a tensor this rank keeps besides (a flat parameter
      shard, a hand-written optimizer's state), registered as its local
      memory.

    Every rank registers the same names with the same shapes in the same
    order (a replacement's state must have the dead rank's layout: pad
    shards to one size). Raises InvalidArgumentError when the Comm takes no
    peer snapshots (``snapshot_every`` 0) or its group has one rank, where
    nothing would keep a copy of the state registered here.
    """
    if comm.group_size < 2:
        raise InvalidArgumentError("ftcomm: protect_shards: the Comm's replica group has %d rank: peer snapshots keep "
                                   "a rank's state on another rank of its group (a group of one heals from its "
                                   "replicas: use register_state)" % comm.group_size, kinds=("invalid_argument",))
    if comm.snapshot_every <= 0:
        raise InvalidArgumentError("ftcomm: protect_shards: the Comm takes no peer snapshots: make it with "
                                   "snapshot_every=K (a copy of every rank's state every K committed steps)",
                                   kinds=("invalid_argument",))
    names = register_state(comm, module, optimizer)
    for name, t in (tensors or {}).items():
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError("ftcomm: protect_shards: tensors[%r] is a %s, not a tensor" % (
                name, type(t).__name__), kinds=("invalid_argument",))
        lt = local_tensor(t)
        if not lt.is_contiguous():
            raise InvalidArgumentError("ftcomm: protect_shards: tensors[%r] is not contiguous: its memory cannot be "
                                       "restored in place" % name, kinds=("invalid_argument",))
        comm.register("tensor/" + name, lt)
        names.append("tensor/" + name)
    for name, obj in (stateful or {}).items():
        register_stateful(comm, name, obj)
        names.append("ftcomm.stateful/" + name)
    return names


# ---------------------------------------------------------------- optimizer

class OptimizerWrapper:
    """An optimizer that steps only on committed ft steps.

    ``zero_grad()`` starts the step (ft.Comm.step: quorum, reconfiguration,
    healing into the registered state; a rollback is healed and taken as
    the step's start), ``step()`` commits it (ft.Comm.commit) and runs the
    optimizer's step only if it committed; it returns whether it did.
    Everything else is the wrapped optimizer's (``param_groups``,
    ``state``, ``state_dict``...). ``FinishedError`` from the ft step (a
    peer ended the run) goes to the caller.

    With a ``sampler`` (ftcomm.ft.Sampler), ``plan`` is the step's plan
    (taken in zero_grad(); None while this replica sits out) and
    ``lr_scaling="linear"`` (the default with a sampler) multiplies every
    param group's learning rate by ``plan.lr_scale`` for the optimizer's
    step alone — the linear scaling rule for a global batch that follows
    the participants — and puts the exact previous value back after it, so
    learning-rate schedulers see and set their own values. ``"none"``
    leaves the learning rate alone.
    """

    def __init__(self, comm, optim: torch.optim.Optimizer, sampler=None, lr_scaling: Optional[str] = None):
        if lr_scaling is None:
            lr_scaling = "linear" if sampler is not None else "none"
        if lr_scaling not in ("linear", "none"):
            raise InvalidArgumentError("ftcomm: OptimizerWrapper: lr_scaling %r: want 'linear' or 'none'" % (
                lr_scaling,), kinds=("invalid_argument",))
        if lr_scaling == "linear" and sampler is None:
            raise InvalidArgumentError("ftcomm: OptimizerWrapper: lr_scaling 'linear' needs a sampler (its plan's "
                                       "lr_scale)", kinds=("invalid_argument",))
        self.comm = comm
        self.optim = optim
        self.sampler = sampler
        self.lr_scaling = lr_scaling
        self.plan = None
        self.last_committed: Optional[bool] = None
        self.rolled_back = 0

    def start_step(self) -> None:
        self.plan = None
        try:
            self.comm.step()
        except RolledBackError:
            self.rolled_back += 1
        if self.sampler is not None:
            try:
                self.plan = self.sampler.plan()
            except NotParticipatingError:
                pass  # sitting out: the commit fails

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.start_step()
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None) -> bool:
        ok = self.comm.commit()
        self.last_committed = ok
        if ok:
            scale = self.plan.lr_scale if self.lr_scaling == "linear" and self.plan is not None else 1.0
            saved = [g["lr"] for g in self.optim.param_groups] if scale != 1.0 else None
            try:
                if saved is not None:
                    for g, lr in zip(self.optim.param_groups, saved):
                        g["lr"] = lr * scale
                self.optim.step(closure) if closure is not None else self.optim.step()
            finally:
                if saved is not None:
                    for g, lr in zip(self.optim.param_groups, saved):
                        g["lr"] = lr
        return ok

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, sd) -> None:
        self.optim.load_state_dict(sd)

    def __repr__(self):
        return "OptimizerWrapper(%r)" % (self.optim,)


# ---------------------------------------------------------------- FT-DDP

class _Completer:
    """Completes the futures of ft collectives in issue order (one thread,
    started with the first and exiting with the process: a daemon)."""

    def __init__(self):
        import queue
        self._q: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._run, name="ftcomm-ft-hook", daemon=True).start()

    def add(self, work, fut, value) -> None:
        self._q.put((work, fut, value))

    def _run(self) -> None:
        while True:
            work, fut, value = self._q.get()
            try:
                work.wait()  # False on failure: recorded for the commit
            except BaseException:  # noqa: B902 - the commit fails; the future must complete
                pass
            fut.set_result(value)


class _HookState:
    def __init__(self, comm, op: ReduceOp):
        self.comm = comm
        self.op = op
        self.completer: Optional[_Completer] = None
        self.failures = 0


def _bucket_tensor(bucket) -> torch.Tensor:
    for name in ("buffer", "get_tensor"):
        f = getattr(bucket, name, None)
        if f is not None:
            return f()
    raise TypeError("ftcomm: DDP's GradBucket has neither buffer() nor get_tensor()")


def _ft_hook(state, bucket):  # (no annotations: DDP checks them against its own types)
    t = _bucket_tensor(bucket)
    fut: torch.futures.Future = torch.futures.Future(devices=[t.device]) if t.is_cuda else torch.futures.Future()
    try:
        w = state.comm.all_reduce(t, state.op, async_op=True)
    except FtcommError:
        # Not taking part in this step (sitting out): the commit fails.
        state.failures += 1
        fut.set_result(t)
        return fut
    if state.completer is None:
        state.completer = _Completer()
    state.completer.add(w, fut, t)
    return fut


def ddp_comm_hook(comm, op: ReduceOp = ReduceOp.AVG):
    """(state, hook) for DistributedDataParallel.register_comm_hook: each
    gradient bucket is reduced (averaged by default) across the replicas by
    the ft.Comm; a failure is recorded for the step's commit."""
    return _HookState(comm, op), _ft_hook


class SoloProcessGroup(dist.ProcessGroup):
    """A process group of this process alone (DDP's own group under FT-DDP:
    its collectives have nothing to exchange)."""

    def __init__(self):
        super().__init__(0, 1)
        import collections
        self._held = collections.OrderedDict()

    def _hold(self, w) -> None:
        from ._dist_works import hold_work
        hold_work(self._held, w)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "ftcomm-solo"

    def _get_backend_name(self) -> str:
        return "ftcomm-solo"

    def _done(self, result):
        from ._dist_works import _DoneWork
        return _DoneWork(self, result)

    def allreduce(self, tensors, opts=None):
        return self._done(list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors])

    def allreduce_coalesced(self, tensors, opts=None):
        return self._done(list(tensors))

    def broadcast(self, tensors, opts=None):
        return self._done(list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors])

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, i in zip(output_tensors, input_tensors):
            outs[0].copy_(i)
        return self._done([o for outs in output_tensors for o in outs])

    def _allgather_base(self, output, input, opts=None):
        output.copy_(input.reshape(output.shape))
        return self._done([output])

    def barrier(self, opts=None):
        return self._done([])


def ft_ddp(module: torch.nn.Module, comm, op: ReduceOp = ReduceOp.AVG, **ddp_kwargs):
    """module in torch's DistributedDataParallel, its gradients averaged
    across the replicas by the ft.Comm (DDP's buckets, overlapped with the
    backward pass; DDP's own group is this process alone). Start every
    replica from the same parameters (the same seed), or heal them: DDP
    broadcasts nothing across replicas."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    # Every replica must cut its gradients into the same buckets, in the
    # same order, at every step. DDP rebuilds its buckets once, after its
    # first iteration, in the order the gradients became ready: a replica
    # that (re)starts while its peers run would all-reduce its first
    # step's buckets against their rebuilt ones. find_unused_parameters
    # keeps the first layout (parameter order: the same everywhere) for
    # good, at the cost of a walk of the autograd graph per forward.
    if ddp_kwargs.get("static_graph"):
        raise FtcommError("ftcomm: ft_ddp: static_graph rebuilds DDP's buckets after the first iteration; a replica "
                          "that restarts would cut its gradients differently from its peers", kinds=("invalid_argument",))
    ddp_kwargs["find_unused_parameters"] = True
    ddp = DDP(module, process_group=SoloProcessGroup(), **ddp_kwargs)
    state, hook = ddp_comm_hook(comm, op)
    ddp.register_comm_hook(state, hook)
    ddp._ftcomm_hook_state = state
    return ddp


# ---------------------------------------------------------------- FT-HSDP

def hsdp_all_reduce_hook(comm, op: ReduceOp = ReduceOp.AVG) -> Callable[[torch.Tensor], None]:
    """FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) for
    HSDP through ft.Comm: the reduce-scattered gradient shard of this rank
    is reduced across the replica groups (FT comm i joins shard rank i of
    every group). The call returns once the op is done (ft's collectives on
    CUDA tensors wait on the host), so FSDP's later work on the stream sees
    the result; a failure is recorded for the commit."""

    def hook(reduce_output: torch.Tensor) -> None:
        try:
            comm.all_reduce(reduce_output, op)
        except FtcommError:
            pass  # sitting out: the commit fails

    return hook


def apply_hsdp(model: torch.nn.Module, comm, shard_mesh, *, blocks=None, op: ReduceOp = ReduceOp.AVG,
               **fully_shard_kwargs) -> torch.nn.Module:
    """FT-HSDP: FSDP2 (``fully_shard``) over shard_mesh (this replica
    group's ranks) for each of blocks (e.g. a transformer's layers) and the
    root, and the all-reduce across replica groups through ft.Comm on every
    FSDP module. Needs torch with FSDP2 and set_all_reduce_hook (>= 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # type: ignore
        except ImportError:
            raise FtcommError("ftcomm: FT-HSDP needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.4); this "
                              "torch is %s" % torch.__version__, kinds=("backend_unavailable",)) from None
    for b in blocks or []:
        fully_shard(b, mesh=shard_mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=shard_mesh, **fully_shard_kwargs)
    hook = hsdp_all_reduce_hook(comm, op)
    n = 0
    for m in model.modules():
        if hasattr(m, "set_all_reduce_hook"):
            m.set_all_reduce_hook(hook)
            n += 1
    if n == 0:
        raise FtcommError("ftcomm: FT-HSDP needs FSDPModule.set_all_reduce_hook (torch >= 2.6); this torch is %s" %
                          torch.__version__, kinds=("backend_unavailable",))
    return model
