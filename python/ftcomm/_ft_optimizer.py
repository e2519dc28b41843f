"""OptimizerWrapper: an optimizer that steps only on committed ft steps
(ftcomm.ft_torch's second piece).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .errors import InvalidArgumentError, NotParticipatingError, RolledBackError


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

    __module__ = "ftcomm.ft_torch"  # where users name it

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
