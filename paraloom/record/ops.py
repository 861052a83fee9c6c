"""What each c10d dispatcher op means for the ledger: its ledger ``op``, which argument holds the
tensors whose logical bytes count, and where its group and peer are.

The byte convention is comm.py's, so a recorded foreign program and paraloom's own ledger compare
field by field: the input of an all-reduce or reduce-scatter (the full local tensor), the local
shard of an all-gather (its input), the tensor of a broadcast / send / recv, the input of an
all-to-all. ``c10d::*`` ops carry a ``ProcessGroup`` (group-local peers); the functional ops used
by DTensor (``_c10d_functional::*``) carry a group name and return their result before it is
ready, to be waited on with ``wait_tensor``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OpSpec", "C10D", "FUNCTIONAL", "tensors_of", "nbytes"]


@dataclass(frozen=True)
class OpSpec:
    """One dispatcher op: ``op`` as the ledger names it, ``data`` the argument whose tensors are
    counted (``None``: nothing travels, a barrier), ``peer`` the group-local peer argument of a
    point-to-point op; ``coalesced`` ops carry several tensors in one call."""

    op: str
    data: str | None
    peer: str | None = None
    coalesced: bool = False


C10D = {
    "allreduce_": OpSpec("all_reduce", "tensors"),
    "allreduce_coalesced_": OpSpec("all_reduce", "tensors", coalesced=True),
    "allgather_": OpSpec("all_gather", "input_tensors"),
    "_allgather_base_": OpSpec("all_gather", "input_tensor"),
    "allgather_coalesced_": OpSpec("all_gather", "input_list", coalesced=True),
    "allgather_into_tensor_coalesced_": OpSpec("all_gather", "inputs", coalesced=True),
    "reduce_scatter_": OpSpec("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": OpSpec("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": OpSpec("reduce_scatter", "inputs", coalesced=True),
    "broadcast_": OpSpec("broadcast", "tensors"),
    "reduce_": OpSpec("reduce", "tensors"),
    "gather_": OpSpec("gather", "input_tensors"),
    "scatter_": OpSpec("scatter", "output_tensors"),
    "alltoall_": OpSpec("all_to_all", "input_tensors"),
    "alltoall_base_": OpSpec("all_to_all", "input"),
    "barrier": OpSpec("barrier", None),
    "send": OpSpec("send", "tensors", peer="dst"),
    "recv_": OpSpec("recv", "tensors", peer="src"),
    "recv_any_source_": OpSpec("recv", "tensors"),
}
"""``c10d::`` ops (what ``torch.distributed``, DDP's C++ reducer and FSDP2 all end in)."""

FUNCTIONAL = {
    "all_reduce": OpSpec("all_reduce", "input"),
    "all_reduce_": OpSpec("all_reduce", "input"),
    "all_reduce_coalesced": OpSpec("all_reduce", "inputs", coalesced=True),
    "all_reduce_coalesced_": OpSpec("all_reduce", "inputs", coalesced=True),
    "all_gather_into_tensor": OpSpec("all_gather", "input"),
    "all_gather_into_tensor_out": OpSpec("all_gather", "input"),
    "all_gather_into_tensor_coalesced": OpSpec("all_gather", "inputs", coalesced=True),
    "reduce_scatter_tensor": OpSpec("reduce_scatter", "input"),
    "reduce_scatter_tensor_out": OpSpec("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": OpSpec("reduce_scatter", "inputs", coalesced=True),
    "all_to_all_single": OpSpec("all_to_all", "input"),
    "broadcast": OpSpec("broadcast", "input"),
    "broadcast_": OpSpec("broadcast", "input"),
    "isend": OpSpec("send", "tensor", peer="dst"),
    "irecv": OpSpec("recv", "tensor", peer="src"),
}
"""``_c10d_functional::`` ops (DTensor, torch.compile'd and traceable collectives); their
``batch_p2p_ops`` is handled apart (one event per op in the batch)."""


def tensors_of(value) -> list:
    """The tensors in an argument: a tensor, a list of them or a list of lists, flattened."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        out = []
        for item in value:
            out.extend(tensors_of(item))
        return out
    return [value]


def nbytes(tensors: list) -> int:
    total = 0
    for t in tensors:
        total += t.numel() * t.element_size()
    return total
