"""Point-to-point communication between neighbouring pipeline stages.

Activations travel to the next stage in forward (phase ``forward``), their gradients back to the
previous stage in backward (phase ``backward``); every transfer is a ``P2POp`` posted through
:func:`paraloom.comm.batch_p2p` (``batch_isend_irecv``) on the pipeline group, recorded with kind
``pp``, its own microbatch and a site naming the Megatron function (``p2p.send_forward``,
``p2p.send_forward_recv_backward``, ...). Neighbours come from the mesh: ``mesh.next_rank`` and
``mesh.prev_rank`` wrap around the ring, which interleaved schedules use to go from the last
stage's chunk ``c`` to the first stage's chunk ``c + 1``.

The schedules post through :func:`post` instead when they overlap communication with
compute (Megatron's ``overlap_p2p_comm``, gloo only): every op starts asynchronously and is
waited for only when its tensor is needed (a receive) or before its buffer is let go (a send).

Why combined batches (Megatron's ``send_forward_recv_backward`` and the like, which is what each
batch's site says): a stage that first waited for its send to finish and only then posted its
receive would deadlock against a neighbour doing the same in the other direction (1F1B's steady
state: stage ``r`` sends an activation forward while stage ``r + 1`` sends a gradient back).
Posting both in one batch lets each pair meet; which ops go together is the schedule's plan
(:func:`paraloom.pipeline_parallel.plans.p2p_plan`).

Shapes: every tensor is ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism), known to both
sides. With ``variable_seq_lengths=True`` the sender first sends the shape as a small int64
tensor (:data:`SHAPE_SLOTS` entries: the number of dims, then the dims, zero-padded); the
receiver validates it (number of dims, no negative size, at most :data:`MAX_ELEMENTS` elements)
before it allocates anything, so a corrupt or mismatched peer gives a ``ValueError`` naming the
peer rank and the shape, never a hang or a huge allocation.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..device import get_device
from ..mesh import ParallelMesh
from .plans import batch_site

__all__ = ["SHAPE_SLOTS", "MAX_ELEMENTS", "communicate", "post", "encode_shape", "decode_shape",
           "tensor_shape_of", "overlap_p2p"]

SHAPE_SLOTS = 8
"""Length of an exchanged shape tensor: ``[ndim, d0, ..., d6]`` (at most 7 dims)."""
MAX_ELEMENTS = 2 ** 31
"""Largest tensor a received shape may describe (a bigger one is taken as corruption)."""


def encode_shape(shape) -> torch.Tensor:
    """``[ndim, *shape, 0, ...]`` as int64 of length :data:`SHAPE_SLOTS`."""
    dims = list(shape)
    if len(dims) > SHAPE_SLOTS - 1:
        raise ValueError(f"cannot exchange a {len(dims)}-dim shape {dims}: at most "
                         f"{SHAPE_SLOTS - 1} dims")
    return torch.tensor([len(dims), *dims] + [0] * (SHAPE_SLOTS - 1 - len(dims)),
                        dtype=torch.int64)


def decode_shape(buffer: torch.Tensor, peer: int, ndim: int | None = None) -> list[int]:
    """Validate a received shape tensor; ``ValueError`` naming ``peer`` if it is not plausible."""
    raw = [int(x) for x in buffer.tolist()]
    n, dims = raw[0], raw[1:]
    if not 1 <= n <= SHAPE_SLOTS - 1:
        raise ValueError(f"p2p shape from rank {peer} is invalid: it claims {n} dims (raw "
                         f"{raw}); valid: 1..{SHAPE_SLOTS - 1}")
    shape = dims[:n]
    if ndim is not None and n != ndim:
        raise ValueError(f"p2p shape from rank {peer} has {n} dims {shape}, expected {ndim} "
                         f"(an [s, b, h] activation)")
    if any(d < 0 for d in shape) or any(dims[n:]):
        raise ValueError(f"p2p shape from rank {peer} is invalid: {shape} (raw {raw}); sizes "
                         f"must be non-negative and the padding zero")
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"p2p shape from rank {peer} is {shape} = {math.prod(shape)} elements, "
                         f"more than the limit {MAX_ELEMENTS}; refusing to allocate it")
    return shape


def _site(ops) -> str:
    """Megatron's name for a batch (:func:`.plans.batch_site`)."""
    return batch_site([(o[0], o[3]) for o in ops])


def communicate(ops, *, mesh: ParallelMesh, tensor_shape, dtype=torch.float32,
                variable_seq_lengths: bool = False, site: str | None = None,
                device: torch.device | None = None) -> list:
    """Post one batch of pipeline sends and receives, wait, and return the received tensors.

    ``ops`` are ``(what, side, tensor, phase, microbatch)``: ``what`` is ``"send"`` (``tensor``
    is sent) or ``"recv"`` (``tensor`` is ``None``; a buffer of ``tensor_shape`` is allocated),
    ``side`` is ``"next"`` or ``"prev"``, ``phase`` ``"forward"`` for activations and
    ``"backward"`` for gradients. Received activations require grad (the stage differentiates
    with respect to them). Ops are posted in the given order, which the peers must mirror per
    direction (see :func:`paraloom.pipeline_parallel.plans.p2p_plan`). Receive buffers go on
    ``device``: by default that of a tensor being sent, else the backend's (:func:`get_device`).
    """
    if not ops:
        return []
    site = site or _site(ops)
    peer_of = {"next": mesh.next_rank, "prev": mesh.prev_rank}
    device = device or next((o[2].device for o in ops if o[2] is not None), None) or get_device()
    shapes = [list(tensor_shape)] * len(ops)
    if variable_seq_lengths:
        batch = [(o[0], encode_shape(o[2].shape) if o[0] == "send" else
                  torch.zeros(SHAPE_SLOTS, dtype=torch.int64), peer_of[o[1]],
                  {"phase": o[3], "microbatch": o[4]} if o[4] is not None else {"phase": o[3]})
                 for o in ops]
        got = comm.batch_p2p([(w, t.to(device), peer, f) for w, t, peer, f in batch], mesh.pp,
                             phase=ops[0][3], kind="pp", site=site + ".shape")
        shapes = [decode_shape(t.cpu(), peer_of[o[1]], len(tensor_shape)) if o[0] == "recv"
                  else None for o, t in zip(ops, got, strict=True)]
    batch = []
    for (what, side, tensor, phase, mb), shape in zip(ops, shapes, strict=True):
        if what == "send":
            tensor = tensor.detach().contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        fields = {"phase": phase} if mb is None else {"phase": phase, "microbatch": mb}
        batch.append((what, tensor, peer_of[side], fields))
    got = comm.batch_p2p(batch, mesh.pp, phase=ops[0][3], kind="pp", site=site)
    out = []
    for (what, _, _, phase, _), tensor in zip(ops, got, strict=True):
        if what == "recv":
            out.append(tensor.requires_grad_() if phase == "forward" else tensor)
    return out


def post(ops, *, mesh: ParallelMesh, tensor_shape, dtype=torch.float32,
         device: torch.device | None = None) -> list:
    """Start ``ops`` (as in :func:`communicate`) without waiting: one handle per op.

    Each op is its own ``batch_p2p`` call (so each can be waited for on its own) recorded as
    ``async``: ``t_start`` when posted, ``t_wait`` / ``t_end`` around its ``wait()``, which
    returns ``[tensor]`` (the filled receive buffer, or the tensor sent). A sent tensor must not
    be modified until its wait returned (gloo reads it meanwhile); the handle keeps it alive.
    Received activations need ``requires_grad_()`` after the wait (the caller's job).
    """
    peer_of = {"next": mesh.next_rank, "prev": mesh.prev_rank}
    handles = []
    for what, side, tensor, phase, mb in ops:
        if what == "send":
            tensor = tensor.detach().contiguous()
        else:
            tensor = torch.empty(tensor_shape, dtype=dtype, device=device or get_device())
        fields = {"phase": phase} if mb is None else {"phase": phase, "microbatch": mb}
        handles.append(comm.batch_p2p([(what, tensor, peer_of[side], fields)], mesh.pp,
                                      phase=phase, kind="pp", site=batch_site([(what, phase)]),
                                      async_op=True))
    return handles


def tensor_shape_of(seq_length: int, micro_batch_size: int, hidden_size: int, mesh: ParallelMesh,
                    sequence_parallel: bool = False) -> tuple[int, int, int]:
    """The ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) tensor between stages."""
    if sequence_parallel and seq_length % mesh.tp.size:
        raise ValueError(f"seq_length = {seq_length} is not divisible by tp = {mesh.tp.size} "
                         f"(needed by sequence_parallel)")
    return (seq_length // mesh.tp.size if sequence_parallel else seq_length, micro_batch_size,
            hidden_size)


def overlap_p2p(requested, device, variable_seq_lengths) -> bool:
    """Whether to run the overlapped plan: by default on gloo (CPU) without shape exchange."""
    gloo = (device or get_device()).type == "cpu"
    if requested is None:
        return gloo and not variable_seq_lengths
    if requested and not gloo:  # NCCL runs a peer pair's p2p in posting order: a receive
        # posted ahead of a send would wait for a peer waiting on that send
        raise ValueError(f"overlap_p2p_comm=True is for gloo (CPU); got a {device} model")
    if requested and variable_seq_lengths:
        raise ValueError("overlap_p2p_comm=True needs fixed shapes (variable_seq_lengths=False): "
                         "a receive is posted before the shape it would need is known")
    return bool(requested)
