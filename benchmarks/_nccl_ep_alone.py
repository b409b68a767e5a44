"""NCCL EP alone, driven through its own Python API, for bench_dispatch_combine.py.

``nccl.ep`` (the nccl-extensions wheel) and ``nccl.core`` (nccl4py) with the
NCCL EP configuration that te_ep_torch's nccl_ep backend uses: the
high-throughput algorithm, the expert-major layout, a send budget of the
tokens per rank rounded up to a multiple of 4, a receive budget of
``capacity`` rows, ``hidden * element size`` row bytes, the handle's zone
alignment, and ``max_num_sms`` left to NCCL EP (as te_ep does). It departs from te_ep
where te_ep's extra work is what the comparison is meant to price: the
overflow policy is TRAP (the benchmark's routing is fixed and fits; te_ep uses
DROP below the worst-case capacity; ``overflow_drop=True`` asks for DROP, to
price that policy on its own), every buffer and descriptor is
made once (a timed call is the library call alone), and nothing zeroes the
rows past the last zone.

``zero_copy=True`` follows NVIDIA's test of that path
(nccl_ep/tests/test_zero_copy.cu): the group is created with ZERO_COPY_ON,
dispatch writes into and combine reads from ``ncclMemAlloc`` buffers
registered as symmetric windows (``NCCL_WIN_COLL_SYMMETRIC``), one for the
received rows and one for the combine input, because combine reduces inside
its input. ``zero_copy=False`` creates the group with ZERO_COPY_OFF and passes
plain torch tensors, which NCCL EP reaches through its own staging buffers.

``flat=True`` is the other route NCCL EP offers: the FLAT layout (one slot per
token and destination rank, with the slot's local expert ids and weights)
followed by te_ep's own permute into the same expert-major rows, and on the way
back te_ep's unpermute (a sum of each slot's local expert rows) before NCCL EP's
combine. Its dispatch and combine times include those te_ep kernels.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from te_ep_torch.permutation import permute, unpermute

# NCCL EP's kernels fetch max_dispatch_tokens_per_rank * top_k routing entries in
# 16-byte units: te_ep rounds the send budget up to this multiple (docs/nccl_ep.md).
SEND_BUDGET_MULTIPLE = 4


def unavailable() -> str:
    """Why NCCL EP can't be driven through its Python API in this process ('' if it can)."""
    try:
        import nccl.core  # noqa: F401
        import nccl.ep

        theirs = nccl.ep.get_lib_path()
    except ImportError as exc:
        return f"cannot import nccl.ep and nccl.core ({exc}); pip install nccl-extensions nccl4py"
    except Exception as exc:  # whatever loading their native libraries raises
        return f"nccl.ep does not load ({type(exc).__name__}: {exc})"
    from te_ep_torch import _nccl_ep as te_nccl_ep

    ours = te_nccl_ep.nccl_ep_library()
    # nccl.ep picks its libnccl_ep.so by the CUDA major of cuda-bindings; a second
    # copy next to te_ep's would be a different build in the same process.
    if theirs is not None and ours is not None and os.path.realpath(theirs) != os.path.realpath(ours):
        return f"nccl.ep loads {theirs}, te_ep_torch loads {ours}: not the same NCCL EP build"
    return ""


def describe() -> str:
    import nccl.ep

    return f"NCCL EP {nccl.ep.get_lib_version()} via nccl.ep ({nccl.ep.get_lib_path()})"


def _communicator(device: torch.device):
    """A new NCCL communicator over the default torch group, from rank 0's unique id."""
    import nccl.core as nc

    rank, world = dist.get_rank(), dist.get_world_size()
    uid = nc.get_unique_id(empty=rank != 0)
    raw = torch.frombuffer(bytearray(uid.as_bytes), dtype=torch.uint8).to(device)
    dist.broadcast(raw, src=0)
    # ncclCommInitRank binds the communicator to the current CUDA device.
    with torch.cuda.device(device):
        return nc.Communicator.init(world, rank, nc.UniqueId.from_bytes(raw.cpu().numpy().tobytes()))


class NcclEpAlone:
    """One NCCL EP group and expert-major handle over fixed tokens and routing (collective)."""

    def __init__(self, *, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, capacity: int, alignment: int, zero_copy: bool, flat: bool = False,
                 overflow_drop: bool = False) -> None:
        import nccl.ep as ep

        self.zero_copy = zero_copy
        self.flat = flat
        self._capacity, self._alignment = capacity, alignment
        self._local_experts = num_experts // dist.get_world_size()
        self._ep = ep
        device = tokens.device
        num_tokens, hidden = tokens.shape
        self._stream = torch.cuda.current_stream(device).cuda_stream
        self._windows = []
        self._group = self._handle = None
        self._comm = _communicator(device)
        try:
            send_budget = -(-num_tokens // SEND_BUDGET_MULTIPLE) * SEND_BUDGET_MULTIPLE
            # FLAT: one slot per (token, destination rank); at most every token of every rank.
            slots = send_budget * dist.get_world_size() if flat else capacity
            self._group = ep.Group.create(self._comm, ep.GroupConfig(
                algorithm=ep.Algorithm.HIGH_THROUGHPUT,
                num_experts=num_experts,
                max_dispatch_tokens_per_rank=send_budget,
                max_recv_tokens_per_rank=slots,
                max_token_bytes=hidden * tokens.element_size(),
                max_num_sms=0,
                zero_copy=ep.ZeroCopyMode.ON if zero_copy else ep.ZeroCopyMode.OFF,
                overflow_policy=ep.OverflowPolicy.DROP if overflow_drop else ep.OverflowPolicy.TRAP,
            ))
            if zero_copy:
                self.recv, recv_desc = self._window_rows(slots, hidden, tokens.dtype, device)
                self._combine_rows, combine_desc = self._window_rows(slots, hidden, tokens.dtype, device)
                self._combine_in = ep.CombineInputs(tokens=combine_desc)
            else:
                self.recv = torch.empty(slots, hidden, dtype=tokens.dtype, device=device)
                recv_desc = ep.Tensor(self.recv)
                self._combine_rows = self._combine_in = None  # combine reads the expert output itself
            top_k = topk_idx.shape[1]
            if flat:
                # Per slot: the K weights and the K local expert ids (-1: not for this rank).
                self._recv_weights = torch.empty(slots, top_k, dtype=torch.float32, device=device)
                self._recv_idx = torch.full((slots, top_k), -1, dtype=torch.int64, device=device)
                recv_idx_desc = ep.Tensor(self._recv_idx)
            else:
                self._recv_weights = torch.empty(slots, dtype=torch.float32, device=device)
                self._recv_idx, recv_idx_desc = None, None
            self._expert_counts = torch.zeros(self._local_experts, dtype=torch.int32, device=device)
            self._recv_total = torch.zeros(1, dtype=torch.int32, device=device)
            self.out = torch.empty_like(tokens)
            self._expert_out = None
            self._perm_map = None
            # The descriptors only point at these tensors: every one stays referenced here.
            self._topk_idx = ep.Tensor(topk_idx)
            self._layout_info = ep.LayoutInfo(
                expert_counters=ep.Tensor(self._expert_counts), recv_total_counter=ep.Tensor(self._recv_total),
                **({"recv_topk_idx_kind": ep.ExpertIdKind.LOCAL} if flat else {}))
            self._dispatch_in = ep.DispatchInputs(tokens=ep.Tensor(tokens), topk_weights=ep.Tensor(topk_weights))
            self._dispatch_out = ep.DispatchOutputs(tokens=recv_desc, topk_weights=ep.Tensor(self._recv_weights),
                                                    topk_idx=recv_idx_desc)
            self._dispatch_config = ep.DispatchConfig(pass_direction=ep.PassDir.FWD)
            self._combine_out = ep.CombineOutputs(tokens=ep.Tensor(self.out))
            self._combine_config = ep.CombineConfig(pass_direction=ep.PassDir.FWD)
            self._handle = self._group.create_handle(
                ep.Layout.FLAT if flat else ep.Layout.EXPERT_MAJOR, self._topk_idx, layout_info=self._layout_info,
                config=None if flat else ep.HandleConfig(dispatch_output_per_expert_alignment=alignment),
                stream=self._stream)
        except BaseException:
            self.close()
            raise

    def _window_rows(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        """``[rows, hidden]`` from ncclMemAlloc, registered as a symmetric window (collective)."""
        import nccl.core as nc
        import nccl.core.interop.torch as nccl_torch

        rows_tensor = nccl_torch.empty(rows, hidden, dtype=dtype, device=device.index)
        window = self._comm.register_window(rows_tensor, nc.WindowFlag.COLL_SYMMETRIC)
        self._windows.append(window)
        if not window.handle:
            raise RuntimeError("NCCL registered no symmetric window (unsupported on this platform)")
        return rows_tensor, self._ep.Tensor(rows_tensor, window=window, window_offset=0)

    def prepare(self) -> None:
        """ncclEpUpdateHandle: the routing exchange, padded per-expert counts and their total."""
        self._handle.update(self._topk_idx, layout_info=self._layout_info, stream=self._stream)

    def dispatch_op(self) -> torch.Tensor:
        """ncclEpDispatch (forward) on the prepared routing; returns the receive rows.

        FLAT: the received slots (one per token and destination rank) are then
        permuted by te_ep's kernel into the same expert-major rows (``capacity``,
        alignment) as the expert-major layout gives. Slots past the received total
        are not written by NCCL EP: their expert ids are reset to -1 first.
        """
        if self.flat:
            self._recv_idx.fill_(-1)
        self._handle.dispatch(self._dispatch_in, self._dispatch_out, config=self._dispatch_config,
                              stream=self._stream)
        if not self.flat:
            return self.recv
        rows, _, self._perm_map = permute(self.recv, self._recv_idx, num_experts=self._local_experts,
                                          capacity=self._capacity, alignment=self._alignment)
        return rows

    def dispatch(self) -> torch.Tensor:
        self.prepare()
        return self.dispatch_op()

    def set_expert_output(self, expert_out: torch.Tensor) -> None:
        """What combine sends back: read in place when staged, copied in by fill_combine_window otherwise."""
        self._expert_out = expert_out
        if not self.zero_copy and not self.flat:
            self._combine_in = self._ep.CombineInputs(tokens=self._ep.Tensor(expert_out))

    def fill_combine_window(self) -> None:
        """Zero-copy expert-major: write the expert output into the combine window, which each combine consumes."""
        if not self.flat:
            self._combine_rows.copy_(self._expert_out)

    def combine(self) -> torch.Tensor:
        """ncclEpCombine (forward): ``[T, hidden]``, each token's expert rows summed.

        FLAT: te_ep's unpermute first sums each slot's local expert rows (timed);
        in zero-copy mode that sum is copied into the combine window (timed too).
        """
        if self.flat:
            slots = unpermute(self._expert_out, self._perm_map)
            if self.zero_copy:
                self._combine_rows.copy_(slots)
            else:
                self._flat_slots = slots  # referenced until the combine has read it
                self._combine_in = self._ep.CombineInputs(tokens=self._ep.Tensor(slots))
        self._handle.combine(self._combine_in, self._combine_out, config=self._combine_config, stream=self._stream)
        return self.out

    def close(self) -> None:
        """Collective: every rank tears down in the same order."""
        torch.cuda.synchronize()
        if self._handle is not None:
            self._handle.destroy()
        if self._group is not None:
            self._group.destroy()
        for window in self._windows:
            window.close()
        self._windows.clear()
        # Window memory goes back to ncclMemFree once nothing references it.
        self.recv = self._combine_rows = self._combine_in = self._dispatch_out = None
        self._comm.destroy()
