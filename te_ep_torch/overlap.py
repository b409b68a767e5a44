"""Communication on a side stream, so that independent compute overlaps it.

:class:`CommStream` runs te_ep ops on a CUDA stream of their own: ``launch`` queues work
there after everything already queued on the caller's current stream, ``join`` makes the
current stream wait for it. The event contract is exactly that fork and join: between
them the current stream may run anything that does not read the launched work's outputs.
When to fork and join is the EP step's (:class:`te_ep_torch.step.EpStep`, whose ``launch``
and ``join`` take the stream or ``None``: no overlap, the work runs at once, in place, so
that one control flow serves both). The module functions :func:`launch`, :func:`join` and
:func:`overlapped` are deprecated (0.3) and go in 0.4.

Memory safety with the caching allocator: a tensor made on one stream and used on the
other is recorded on the stream that uses it (``Tensor.record_stream``), so its memory is
not handed to another allocation before that stream's kernels are done with it: inputs of
the launched work are recorded on the communication stream, its outputs on the current
stream at ``join``. Without the record, an input whose last reference the caller drops
right after the launch would go back to the current stream's pool at once, and a tensor
allocated next on that stream could take its memory and overwrite it before the delayed
communication kernel reads it (tests/test_moe.py, ``test_overlap_record_stream_gpu``
shows exactly that with the record taken out). Memory te_ep owns (zero-copy windows) is
not the allocator's and needs no record.

Autograd: the backward of an op that ran on the communication stream runs there too, and
the autograd engine synchronizes the streams where gradients cross them (PyTorch's
"stream semantics of backward passes": the consumer stream waits on an event of the
producer stream and the gradient is recorded on the consumer stream), so the backward
overlaps the same way.

Where it does nothing: on CPU (no streams) and under ``torch.compile`` (the compiled graph
runs on the caller's stream: the layer is sequential there). A CUDA graph captures the fork
and the join, so a captured layer overlaps too. docs/moe.md, "Overlap".
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, Optional, Tuple, TypeVar

import torch
from torch import Tensor

__all__ = ["CommStream", "comm_stream_for", "join", "launch", "overlapped"]

T = TypeVar("T")

_streams: Dict[int, "CommStream"] = {}


def _record_stream(t: Tensor, stream: torch.cuda.Stream) -> None:
    """``t.record_stream(stream)``: every record of this module goes through here (a test
    replaces it to show the corruption a missing record causes)."""
    t.record_stream(stream)


class CommStream:
    """A communication stream of one CUDA device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        # High priority: communication kernels wait on other GPUs; let them in first.
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1)

    def launch(self, fn: Callable[[], T], inputs: Iterable[Optional[Tensor]]) -> T:
        """``fn()`` on the communication stream, after the current stream's queued work.

        ``inputs`` are the tensors ``fn`` reads that were made on the current stream.
        """
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            result = fn()
        for t in inputs:
            if t is not None and t.is_cuda:
                _record_stream(t, self.stream)
        return result

    def record(self) -> torch.cuda.Event:
        """An event recorded on the communication stream now: behind the work launched so far and
        ahead of any launched later (what :meth:`join`'s ``after`` waits for)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self, outputs: Iterable[Optional[Tensor]], after: Optional[torch.cuda.Event] = None) -> None:
        """The current stream waits for the launched work; its ``outputs`` become usable there.

        ``after``: the :meth:`record` event taken right behind that work, so the wait ends there
        and not behind work launched since (a chunked step's next combine); ``None``: behind
        everything launched so far."""
        current = torch.cuda.current_stream(self.device)
        if after is None:
            current.wait_stream(self.stream)
        else:
            current.wait_event(after)
        for t in outputs:
            if t is not None and t.is_cuda:
                _record_stream(t, current)


def comm_stream_for(device: torch.device) -> Optional[CommStream]:
    """The device's communication stream, or ``None`` where overlap does not apply (CPU,
    ``torch.compile``): callers then run sequentially. Under CUDA graph capture the fork and
    join are captured like any other stream dependency."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = CommStream(torch.device("cuda", index))
    return stream


def _deprecated(name: str, instead: str) -> None:
    warnings.warn(f"te_ep_torch.overlap.{name} is deprecated and will be removed in 0.4: {instead}", FutureWarning,
                  stacklevel=3)


def launch(comm: Optional[CommStream], fn: Callable[[], T], inputs: Iterable[Optional[Tensor]]) -> T:
    """Deprecated: :meth:`CommStream.launch` (``fn()`` at once where there is no stream), or
    :class:`te_ep_torch.step.EpStep`, which owns when a layer's ops fork and join."""
    _deprecated("launch", "call CommStream.launch, or let te_ep_torch.step.EpStep run the step")
    return fn() if comm is None else comm.launch(fn, inputs)


def join(comm: Optional[CommStream], result: T) -> T:
    """Deprecated: :meth:`CommStream.join`, or :class:`te_ep_torch.step.EpStep`."""
    _deprecated("join", "call CommStream.join, or let te_ep_torch.step.EpStep run the step")
    if comm is not None:
        comm.join(_tensors(result))
    return result


def overlapped(comm: Optional[CommStream], fn: Callable[[], T], inputs: Iterable[Optional[Tensor]],
               meanwhile: Optional[Callable[[], object]] = None) -> Tuple[T, object]:
    """Deprecated: ``fn()`` on the communication stream while ``meanwhile()`` runs on the
    current one, then the join (``EpStep.run``'s ``behind_dispatch`` does this for a layer)."""
    _deprecated("overlapped", "use te_ep_torch.step.EpStep.run(..., behind_dispatch=...)")
    result = fn() if comm is None else comm.launch(fn, inputs)
    side = meanwhile() if meanwhile is not None else None
    if comm is not None:
        comm.join(_tensors(result))
    return result, side


def _tensors(result: object) -> Tuple[Optional[Tensor], ...]:
    """The tensors of launched work's result: itself, or the tensor fields of a tuple."""
    if isinstance(result, Tensor):
        return (result,)
    if isinstance(result, tuple):
        return tuple(t for t in result if isinstance(t, Tensor))
    raise TypeError(f"te_ep_torch: launched work must return a tensor or a tuple of tensors, got {type(result)}")
