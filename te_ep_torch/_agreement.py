"""Configuration agreement across the ranks of an EP group (one host collective).

``EpGroup(...)`` and ``EpGroup.create_handle(...)`` are collective: every rank
of the group must pass the same configuration, or NCCL EP (and the reference
backend's exchanges) would wait forever for ranks that sized their buffers
differently. Each rank validates its own arguments first *without raising*, then
the ranks exchange ``(their values, their error)`` once; every rank then raises
the same error, naming the ranks, the field and the values seen, or none does.
"""

from __future__ import annotations

import builtins
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

_EXCEPTIONS = (ValueError, TypeError, RuntimeError)


def local_error(check: Callable[[], object]) -> Tuple[object, Optional[Tuple[str, str]]]:
    """Runs ``check``; returns ``(its result, None)`` or ``(None, (exception type name, message))``.

    Only argument errors (ValueError, TypeError, RuntimeError) are held back for the
    agreement; anything else propagates at once.
    """
    try:
        return check(), None
    except _EXCEPTIONS as exc:
        return None, (type(exc).__name__, str(exc))


def agree(
    process_group: dist.ProcessGroup,
    what: str,
    fields: Dict[str, object],
    error: Optional[Tuple[str, str]] = None,
) -> None:
    """Collective over ``process_group``: raises on every rank if any rank had ``error``
    or the ranks disagree on any of ``fields`` (compared by ``repr``).

    The message starts with ``what`` (e.g. ``"EpGroup"``, ``"create_handle"``) and names
    the ranks and values, e.g. ``create_handle: the ranks of the EP group must pass the
    same configuration; they disagree on hidden (rank 0: 64, rank 1: 32)``.
    """
    world = dist.get_world_size(process_group)
    mine = ({k: repr(v) for k, v in fields.items()}, error)
    gathered: List[object] = [None] * world
    dist.all_gather_object(gathered, mine, group=process_group)

    failed = [(rank, err) for rank, (_, err) in enumerate(gathered) if err is not None]
    if failed:
        kind = failed[0][1][0]
        exc_type = getattr(builtins, kind, RuntimeError)
        if not (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
            exc_type = RuntimeError
        messages = {msg for _, (_, msg) in failed}
        if len(failed) == world and len(messages) == 1:
            raise exc_type(messages.pop())
        detail = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in failed)
        raise exc_type(f"{what}: failed on {len(failed)} of {world} ranks: {detail}")

    mismatches = []
    for name in fields:
        values = [g[0][name] for g in gathered]
        if len(set(values)) > 1:
            seen = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            mismatches.append(f"{name} ({seen})")
    if mismatches:
        raise ValueError(
            f"{what}: the ranks of the EP group must pass the same configuration; they disagree on "
            + "; ".join(mismatches)
        )
