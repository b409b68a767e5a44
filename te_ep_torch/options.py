"""The EP options of a layer, in one record validated once.

Every entry point that makes expert-parallel layers (``te.MoE.enable_expert_parallel``,
``ExpertParallel`` / ``parallelize_moe_model``, the TorchTitan dispatcher, both transformers
entries) turns its arguments into one :class:`EpOptions`; the record checks each value once,
with a message naming the argument and the value it expects, and gives the group's and the
handles' keyword arguments. The rules behind the capacity fields are
:mod:`te_ep_torch.capacity`'s.

Those entry points take the record as ``options=EpOptions(...)``. Their per-option keywords
(``backend=``, ``capacity_factor=``, ...) still work in 0.3 but are deprecated: passing one
warns ``FutureWarning`` (:meth:`EpOptions.resolve`, the one place of that rule), and 0.4
removes them.
"""

from __future__ import annotations

import dataclasses
import datetime
import numbers
import warnings
from typing import Any, Dict, Optional, Union

from .capacity import check_capacity_factor
from .group import BACKENDS, CHECKS, DEFAULT_NCCL_EP_MODE, NCCL_EP_MODES, OVERFLOWS

__all__ = ["EpOptions", "UNSET"]

# The release that drops the EP keywords of the entry points (deprecated in 0.3.0).
KEYWORDS_REMOVED_IN = "0.4"


class _Unset:
    """The default of an entry point's deprecated EP keyword: "not passed", told apart from
    any value (``None`` included), so that only a keyword passed explicitly warns."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"  # copies and pickles are the one module-level sentinel


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class EpOptions:
    """How a layer's tokens travel (defaults: what a user gets without asking).

    Group options (shared by the layers of one :class:`~te_ep_torch.EpGroup`):

    Attributes:
        backend: ``"auto"``, ``"reference"`` or ``"nccl_ep"`` (:class:`~te_ep_torch.EpGroup`).
        nccl_ep_mode: ``"zero_copy"`` (default), ``"staged"`` or ``"auto"``.
        timeout: seconds (or a ``timedelta``) an ``nccl_ep`` op may take; ``None``: the
            process group's.
        checks: the check mode, ``"local"``, ``"device"`` or ``"synchronous"``.

    Handle options (one handle per layer and token dtype):

    Attributes:
        capacity: receive rows; ``None`` with no ``capacity_factor``: the worst case.
        capacity_factor: the receive rows as a multiplier (>= 1.0) of a rank's mean load
            (:func:`te_ep_torch.capacity.capacity_for_factor`); not with ``capacity``.
        overflow: ``"raise"`` or ``"drop"`` (:func:`te_ep_torch.capacity.drop_past_share`).

    Step options:

    Attributes:
        chunks: split a step's tokens into this many chunks, each with handles of its own
            (:class:`~te_ep_torch.step.EpStep`), so that on a communication stream one chunk's
            dispatch and another's combine run while a third chunk's experts compute, in
            forward and backward. ``1`` (default): one dispatch and one combine per step.
            ``capacity`` and ``capacity_factor`` keep meaning the whole step's receive rows:
            each chunk's handle gets its share (docs/moe.md, "Chunked step").
        comm_sms: SMs that the expert GEMMs running beside the step's communication kernels
            leave free: a chunked step's experts, forward and backward, and on a communication
            stream the experts' weight gradients under ``dispatch_bwd`` (torch's SM carveout for
            its persistent GEMMs, ``torch._grouped_mm`` and cuBLAS: a GEMM that holds every SM
            keeps NCCL EP's kernels from starting until it ends). ``0`` (default): none. Used on
            CUDA with a communication stream (``chunks`` > 1 or ``MoE(overlap=True)``); compiled
            layers run sequentially and ignore it.
    """

    backend: str = "auto"
    nccl_ep_mode: str = DEFAULT_NCCL_EP_MODE
    timeout: Union[None, float, datetime.timedelta] = None
    checks: str = "local"
    capacity: Optional[int] = None
    capacity_factor: Optional[float] = None
    overflow: str = "raise"
    chunks: int = 1
    comm_sms: int = 0

    def __post_init__(self) -> None:
        self.validate("EpOptions")

    def validate(self, what: str) -> None:
        """Raises ``ValueError`` naming ``what`` and the first field that is not valid."""
        for name, allowed in (("backend", BACKENDS), ("nccl_ep_mode", NCCL_EP_MODES), ("checks", CHECKS),
                              ("overflow", OVERFLOWS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(f"{what}: {name} must be one of {allowed}, got {value!r}")
        timeout = self.timeout
        if timeout is not None and not (
            (isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0)
            or (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout > 0)
        ):
            raise ValueError(f"{what}: timeout must be None or a positive number of seconds, got {timeout!r}")
        capacity = self.capacity
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0):
            raise ValueError(f"{what}: capacity must be None (the worst case) or a positive int, got {capacity!r}")
        if capacity is not None and self.capacity_factor is not None:
            raise ValueError(f"{what}: pass capacity (rows) or capacity_factor (a multiplier of the mean load), not "
                             f"both; got capacity={capacity!r}, capacity_factor={self.capacity_factor!r}")
        check_capacity_factor(self.capacity_factor, what)
        chunks = self.chunks
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"{what}: chunks must be an int >= 1 (1: an unchunked step), got {chunks!r}")
        sms = self.comm_sms
        if not isinstance(sms, int) or isinstance(sms, bool) or sms < 0:
            raise ValueError(f"{what}: comm_sms must be an int >= 0 (0: the GEMMs keep every SM), got {sms!r}")

    @classmethod
    def build(cls, what: str, **fields: Any) -> "EpOptions":
        """The record of ``fields`` (others at their defaults), errors naming ``what``:
        an entry point's keywords in, one validated record out."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{what}: unknown EP option {unknown[0]!r}")
        # Built past __post_init__ (which would name "EpOptions"), then validated naming `what`.
        obj = object.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(obj, f.name, fields.get(f.name, f.default))
        obj.validate(what)
        return obj

    @classmethod
    def resolve(cls, what: str, options: Optional["EpOptions"], *, stacklevel: int = 1,
                **keywords: Any) -> "EpOptions":
        """What an entry point that takes both ``options`` and its (deprecated) EP keywords runs
        with: ``options``, else the record of the keywords passed (others at their defaults).

        ``keywords`` are the entry point's EP keywords as the caller left them: :data:`UNSET`
        (their default) where not passed. Any passed explicitly warns ``FutureWarning`` naming
        ``what``, the keywords and the ``options=EpOptions(...)`` that replaces them (removed in
        :data:`KEYWORDS_REMOVED_IN`); one passed away from its default besides ``options`` is
        ``ValueError`` (two answers to one question). ``stacklevel``: the frames between the
        entry point and this call, plus one (1: the entry point calls this), so that the
        warning points at the entry point's caller."""
        given = {name: value for name, value in keywords.items() if value is not UNSET}
        if options is None:
            record = cls.build(what, **given)  # errors (an unknown or bad keyword) before the warning
        elif not isinstance(options, EpOptions):
            raise TypeError(f"{what}: options must be a te_ep_torch.EpOptions, got {type(options).__name__}")
        else:
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
            changed = sorted(name for name, value in given.items() if value != defaults.get(name, UNSET))
            if changed:
                raise ValueError(f"{what}: pass options=EpOptions(...) or the keywords, not both; got options and "
                                 f"{', '.join(changed)}")
            record = options
        if given:
            args = ", ".join(f"{f.name}=..." for f in dataclasses.fields(cls) if f.name in given)
            warnings.warn(f"{what}({args}) is deprecated and will be removed in {KEYWORDS_REMOVED_IN}: pass "
                          f"options=te.EpOptions({args})", FutureWarning, stacklevel=stacklevel + 2)
        return record

    def group_kwargs(self) -> Dict[str, Any]:
        """The :func:`~te_ep_torch.parallel.ep_group_for` / :class:`~te_ep_torch.EpGroup` keywords."""
        return {"backend": self.backend, "nccl_ep_mode": self.nccl_ep_mode, "timeout": self.timeout,
                "checks": self.checks}

    def handle_kwargs(self) -> Dict[str, Any]:
        """The :meth:`~te_ep_torch.EpGroup.create_handle` keywords (``checks``: ``None``, the group's)."""
        return {"capacity": self.capacity, "capacity_factor": self.capacity_factor, "overflow": self.overflow}
