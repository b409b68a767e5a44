"""What every benchmark script shares: environment, process group, timer, table and CSV.

Import it before torch: NCCL, torch's symmetric memory and NVSHMEM read the
variables below when they initialise, and NVLink multicast is never used by these
benchmarks (a user may still override any of them in the environment).
"""

from __future__ import annotations

import os

MULTICAST_OFF = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
)
for _name, _value in MULTICAST_OFF:
    os.environ.setdefault(_name, _value)

import csv  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union  # noqa: E402

# A checkout built in place (setup.py build_ext --inplace) is measured before an
# installed te_ep_torch, but after what PYTHONPATH names (another build to compare):
# its place is right after the last PYTHONPATH entry, else after the script's folder.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "te_ep_torch" / "_C.so").exists():
    _named = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _last = max((i for i, p in enumerate(sys.path) if os.path.realpath(p or ".") in _named), default=0)
    sys.path.insert(_last + 1, str(_REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def init_distributed(kind: str) -> torch.device:
    """Joins torchrun's process group: NCCL with one GPU per rank (``cuda``) or gloo (``cpu``)."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (use --device cpu to test the script)")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def close_distributed() -> None:
    # Gloo aborts a rank whose peer tore its connections down first.
    dist.barrier()
    dist.destroy_process_group()


def leave(code: int) -> None:
    """Ends a script that used DTensor, once everything is shut down and written, without Python's
    finalization (as examples/moe_train.py ends): torch's DTensor keeps the device meshes it has
    seen, and with them the process group and gloo's worker threads, alive past
    ``dist.destroy_process_group()``, and a worker still releasing a finished collective's tensors
    (which needs the GIL) while the interpreter finalizes aborts the process now and then
    ("terminate called without an active exception"). An exception from ``main()`` never gets
    here: it takes the normal path, traceback included."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# How long the GPU spins before a queued call: longer than the host path of any
# op timed here (te_ep's is 0.05-0.3 ms).
QUEUE_AHEAD_MS = 2.0
_sleep_cycles_per_ms: Dict[int, float] = {}


def _spin(ms: float, device: torch.device) -> None:
    """Keeps the current stream of `device` busy for about `ms` (torch.cuda._sleep counts cycles, not time)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sleep_cycles_per_ms:
        probe = 1 << 20
        torch.cuda._sleep(probe)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        _sleep_cycles_per_ms[index] = probe / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(ms * _sleep_cycles_per_ms[index]))


class Timing(NamedTuple):
    """Median milliseconds of one call; on the CPU every field is the wall time of the call."""

    ms: float  # CUDA events around the call on an idle GPU: its host path up to the first kernel counts
    host_ms: float  # wall time of that call on the host alone (launches, checks, Python; no synchronisation)
    queued_ms: float  # the call issued behind a QUEUE_AHEAD_MS spin, timed from the spin's end: its GPU time


def _events_ms(fn: Callable[[], object], device: torch.device, queued: bool,
               nvtx: Optional[str] = None) -> Tuple[float, float]:
    """(CUDA events around one call of fn, wall time of the call on the host); ``nvtx``: the
    name of an NVTX range around the call (" queued" appended when queued)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        _spin(QUEUE_AHEAD_MS, device)
    start.record()
    if nvtx is not None:
        torch.cuda.nvtx.range_push(nvtx + (" queued" if queued else ""))
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    if nvtx is not None:
        torch.cuda.nvtx.range_pop()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host


class Call(NamedTuple):
    """One call to time (interleaved_median_ms): the call, what runs ahead of it outside the
    timed region, and the name of the NVTX range around it (None: no range)."""

    fn: Callable[[], object]
    before: Optional[Callable[[], object]] = None
    nvtx: Optional[str] = None


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int, *, ranks: bool,
              before: Optional[Callable[[], object]] = None, idle: bool = True, queued: bool = False,
              nvtx: Optional[str] = None) -> Timing:
    """Medians of `iters` timed calls of fn, after `warmup` untimed ones.

    `before` runs ahead of every call, outside the timed region (inputs in place,
    gradients reset, an L2 flush). Each timed call then starts with the GPU idle;
    on a GPU, `idle` asks for ``ms`` and ``host_ms`` and `queued` for
    ``queued_ms`` (fields not asked for are nan), each from a call of its own.
    ``ranks``: every call starts after a barrier and each median is the slowest
    rank's. ``nvtx``: each timed call on a GPU inside an NVTX range of that name.
    """
    return interleaved_median_ms([Call(fn, before, nvtx)], device, warmup, iters, ranks=ranks, idle=idle,
                                 queued=queued)[0]


def interleaved_median_ms(calls: Sequence[Call], device: torch.device, warmup: int, iters: int, *, ranks: bool,
                          idle: bool = True, queued: bool = False) -> List[Timing]:
    """median_ms of each of `calls`, the calls taking turns: each iteration times every call
    once (in order, and in the reverse order every other iteration), so that a drift of the
    machine over the iterations weighs on every call alike and their ratios hold it out.
    Each call's `warmup` untimed calls come first, in order."""
    for call in calls:
        for _ in range(warmup):
            if call.before is not None:
                call.before()
            call.fn()
    synchronize(device)

    def ready(call: Call) -> None:
        if call.before is not None:
            call.before()
        if ranks:
            dist.barrier()
        synchronize(device)

    samples: List[Tuple[List[float], List[float], List[float]]] = [([], [], []) for _ in calls]
    for i in range(iters):
        for j in (range(len(calls)) if i % 2 == 0 else reversed(range(len(calls)))):
            call, (times, host, queued_times) = calls[j], samples[j]
            if device.type != "cuda":
                ready(call)
                t0 = time.perf_counter()
                call.fn()
                wall = (time.perf_counter() - t0) * 1e3
                times.append(wall)
                host.append(wall)
                queued_times.append(wall)
                continue
            if idle:
                ready(call)
                gpu, on_host = _events_ms(call.fn, device, queued=False, nvtx=call.nvtx)
                times.append(gpu)
                host.append(on_host)
            if queued:
                ready(call)
                queued_times.append(_events_ms(call.fn, device, queued=True, nvtx=call.nvtx)[0])
    medians = [[statistics.median(v) if v else math.nan for v in per_call] for per_call in samples]
    if ranks:
        result = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        medians = result.tolist()
    return [Timing(*m) for m in medians]


class Column(NamedTuple):
    """A table column: its title, the format spec of its cells (alignment and width, ``">8"``),
    the row key or a function of the row giving the value, and the value's format spec.
    A value that is None or nan prints as ``-``."""

    title: str
    align: str
    value: Union[str, Callable[[Dict], object]]
    fmt: str = ""


def _cell(column: Column, row: Dict) -> str:
    value = column.value(row) if callable(column.value) else row[column.value]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, column.fmt)


def print_table(columns: Sequence[Column], rows: Sequence[Dict]) -> None:
    header = " ".join(format(c.title, c.align) for c in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(" ".join(format(_cell(c, row), c.align) for c in columns))


def write_csv(path: str, rows: Sequence[Dict]) -> None:
    """One line per row; the columns are every key of any row, in order of appearance."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
