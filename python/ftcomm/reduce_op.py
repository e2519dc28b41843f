"""Reductions, with torchcomms' names: ``ReduceOp.SUM`` … ``ReduceOp.AVG``,
``ReduceOp.PREMUL_SUM(factor)``, and ``op.type`` a ``RedOpType``."""

from __future__ import annotations

import enum
from typing import Any, Optional


class RedOpType(enum.Enum):
    """The kind of a ReduceOp."""

    SUM = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8
    AVG = 9


# The comm.ReduceOp code of each kind (PREMUL_SUM is a multiply, then SUM).
_CODES = {RedOpType.SUM: 1, RedOpType.PRODUCT: 2, RedOpType.MIN: 3, RedOpType.MAX: 4, RedOpType.AVG: 5,
          RedOpType.BAND: 6, RedOpType.BOR: 7, RedOpType.BXOR: 8, RedOpType.PREMUL_SUM: 1}


class ReduceOp:
    """A reduction of all_reduce, reduce, reduce_scatter (and their _single
    and _v forms).

    SUM, PRODUCT, MIN, MAX on every dtype; AVG divides the sum by the
    number of ranks (an integer dtype's division truncates toward zero, as
    NCCL's ncclAvg); BAND, BOR, BXOR on integer and bool dtypes (gloo only:
    NCCL has no bitwise reductions); ``PREMUL_SUM(factor)`` multiplies each
    rank's input by factor (a number, or a one-element tensor of the
    input's dtype: another dtype is refused, as torch's NCCL and torchcomms
    refuse it) and sums, on floating-point dtypes, as NCCL's PreMulSum: the
    factor taken as a value of the input's dtype, each product rounded
    once. On bool tensors SUM and MAX are a logical or, PRODUCT and MIN a
    logical and.
    """

    __slots__ = ("_type", "_factor", "_code")

    SUM: "ReduceOp"
    PRODUCT: "ReduceOp"
    MIN: "ReduceOp"
    MAX: "ReduceOp"
    BAND: "ReduceOp"
    BOR: "ReduceOp"
    BXOR: "ReduceOp"
    AVG: "ReduceOp"

    def __init__(self, type: RedOpType = RedOpType.SUM, factor: Any = None):
        if not isinstance(type, RedOpType):
            raise TypeError("ReduceOp: type %r is not a RedOpType" % (type,))
        if (factor is None) != (type is not RedOpType.PREMUL_SUM):
            raise ValueError("ReduceOp: PREMUL_SUM takes a factor, and only it does")
        self._type, self._factor, self._code = type, factor, _CODES[type]

    @staticmethod
    def PREMUL_SUM(factor: Any) -> "ReduceOp":  # noqa: N802 - torchcomms' name
        """Sum of every rank's input multiplied by factor (a number, or a
        one-element tensor)."""
        return ReduceOp(RedOpType.PREMUL_SUM, factor)

    @property
    def type(self) -> RedOpType:
        return self._type

    @property
    def factor(self) -> Optional[Any]:
        return self._factor

    @property
    def name(self) -> str:
        return self._type.name

    def __eq__(self, other) -> bool:
        if isinstance(other, RedOpType):
            return self._type is other
        if isinstance(other, ReduceOp):
            return self._type is other._type and self._factor is other._factor
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._type, id(self._factor)))

    def __repr__(self) -> str:
        if self._type is RedOpType.PREMUL_SUM:
            return "ReduceOp.PREMUL_SUM(%r)" % (self._factor,)
        return "ReduceOp." + self._type.name


for _t in RedOpType:
    if _t is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _t.name, ReduceOp(_t))
del _t


def as_reduce_op(op: Any) -> ReduceOp:
    """op as a ReduceOp: a ReduceOp, or a RedOpType other than PREMUL_SUM."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, RedOpType) and op is not RedOpType.PREMUL_SUM:
        return getattr(ReduceOp, op.name)
    from .errors import InvalidTypeError
    raise InvalidTypeError("ftcomm: reduce op %r: want a ReduceOp (ReduceOp.SUM, ReduceOp.PREMUL_SUM(2.0), …)" % (op,),
                           kinds=("invalid_argument",))
