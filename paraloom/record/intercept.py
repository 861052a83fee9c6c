"""Where the recorder sees communication: Python kernels on the c10d dispatcher ops.

Every communication path of torch 2.13 ends in a dispatcher op: ``torch.distributed``'s
functions, Megatron-Core's import-time aliases of them (``dist_all_gather_func``), DDP's C++
reducer and FSDP2 call ``c10d::allreduce_`` / ``c10d::_allgather_base_`` /
``c10d::_reduce_scatter_base_`` / ``c10d::send`` / ... through ``ProcessGroup``; DTensor uses the
functional ops ``_c10d_functional::*`` (which reach the backend directly, not through
``c10d::*``) and waits with ``_c10d_functional::wait_tensor``. Wrapping the Python functions of
``torch.distributed`` misses the aliases, the reducer and FSDP2 (measured); so the recorder
registers a Python kernel for each of these ops at the ``AutogradCPU`` / ``AutogradCUDA``
dispatch keys (``torch.library.Library(ns, "IMPL")``), records the call and redispatches below
autograd to the real kernel. Measured on torch 2.13 (2 gloo ranks): this sees DDP's bucket
all-reduces, FSDP2's all-gathers and reduce-scatters (forward, backward re-gather), DTensor's
functional all-reduces, send/recv and batch_isend_irecv, and the aliases.

Why not a ``TorchDispatchMode`` (what CommDebugMode uses): it also sees every c10d op, but it
runs Python for *every aten op* of the program, and it is thread-local state that must be pushed
onto autograd's device threads. A dispatcher kernel is global (it fires on every thread, the
autograd engine's included) and costs nothing on the ops that do not communicate. The figures are
in ``benchmarks/record_overhead.py``. What it cannot see: collectives issued with autograd keys
excluded (inside ``torch.inference_mode`` or another tensor subclass's ``__torch_dispatch__``).

``async``: the op's own ``async_op`` argument (``torch.distributed``'s blocking functions pass
``False`` and wait inside the wrapper; DDP's reducer and ``async_op=True`` callers get the Work
back); send/recv have no such argument, so they are blocking when called from
``torch.distributed.send``/``recv`` and asynchronous otherwise (``isend``, ``batch_isend_irecv``);
functional collectives are asynchronous (waited by ``wait_tensor``). When each ends is
:mod:`.completion`'s. On CUDA every stamp is a CUDA event on the current
stream from the program's first CUDA collective on (``Ledger.use_device_clock``): ``t_start``
when the device reaches the launch, ``t_end`` when it reaches the point after the wait (a
Work's wait orders the stream; the host returns earlier), resolved into seconds when the
recorder rewrites its lines at a step boundary (waiting for those events only).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from functools import partial

import torch
import torch.distributed.distributed_c10d as c10d

from . import completion
from .completion import _UNSEEN, hold_output, hold_work, poll, poll_now, prune, settle, timed_wait
from .ops import C10D, FUNCTIONAL, OpSpec, tensors_of

__all__ = ["install", "uninstall", "prune", "poll", "settle", "installed", "logical"]

_KEYS = ("ADInplaceOrView",)
_BELOW = torch._C._after_ADInplaceOrView_keyset
_Work = torch._C._distributed_c10d.Work
_PG = torch._C._distributed_c10d.ProcessGroup
_C10D_FILE = c10d.__file__
_BLOCKING_P2P = ("send", "recv")
_IS_TENSOR = torch.Tensor.__instancecheck__  # isinstance(x, Tensor) without a generator frame

_SINK = None  # the active recorder: .on, .now(), .launch(op, tensors, pg, peer, async_op, ...)
_LIBS: list = []
_INSIDE = threading.local()  # .depth > 0 while a recorded op runs (its kernel may call others)
_LOGICAL = None  # (tensors, fields) the next recorded op is recorded as (see :func:`logical`)


def installed() -> bool:
    return bool(_LIBS)


def install(sink) -> None:
    """Register the kernels and route what they see to ``sink`` (one sink per process)."""
    global _SINK
    if _LIBS:
        raise RuntimeError("paraloom record: a recorder is already active in this process "
                           "(record_comms blocks cannot nest)")
    _SINK = sink
    for ns, table in (("c10d", C10D), ("_c10d_functional", FUNCTIONAL)):
        lib = torch.library.Library(ns, "IMPL")
        packet = getattr(torch.ops, ns)
        names = list(table) + (["batch_p2p_ops"] if ns != "c10d" else [])
        for name in names:
            op = getattr(packet, name).default
            args = {a.name: i for i, a in enumerate(op._schema.arguments)}
            if ns == "c10d":
                fn = _c10d_kernel(op, table[name], args)
            else:
                fn = partial(_functional_kernel, _op=op, _spec=table.get(name), _args=args,
                             _name=name)
            for key in _KEYS:
                lib.impl(name, fn, key, with_keyset=True)
        _LIBS.append(lib)
    completion.install(sink)


def uninstall() -> None:
    """Remove the kernels (the real ones are back) and forget pending Works."""
    global _SINK
    for lib in _LIBS:
        lib._destroy()
    _LIBS.clear()
    completion.uninstall()
    _SINK = None


def _bind(args: dict, values: tuple, kwargs: dict) -> dict:
    bound = dict(zip(args, values, strict=False))
    bound.update(kwargs)
    return bound


def _arg(args: dict, values: tuple, kwargs: dict, name: str, default=None):
    """One argument of a dispatcher call by its schema name (``args``: name -> position), as
    the Python kernel received it: positionally, or by name (trailing defaults come as kwargs)."""
    i = args.get(name)
    if i is not None and i < len(values):
        return values[i]
    return kwargs.get(name, default)


def _blocking_p2p() -> bool:
    """Whether a send/recv was called by torch.distributed.send / recv (which wait at once)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _C10D_FILE and code.co_name in _BLOCKING_P2P:
            return True
        frame = frame.f_back
    return False


def _inside() -> bool:
    return getattr(_INSIDE, "depth", 0) > 0


def _run(op, keyset, values, kwargs):
    """Call the real kernel with this thread marked busy: an op implemented by calling another
    (functional ``all_reduce`` runs ``all_reduce_``) is one communication, recorded once."""
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        return op.redispatch(keyset & _BELOW, *values, **kwargs)
    finally:
        _INSIDE.depth -= 1


def _c10d_kernel(op, spec: OpSpec, args: dict):
    """The kernel of one ``c10d::`` op (``args``: its schema's argument positions). It runs at
    every collective of the program, DDP's bucket all-reduces included: its path is kept short
    (``benchmarks/record_overhead.py``)."""
    redispatch = op._handle.redispatch_boxed  # OpOverload.redispatch without its frame
    at_data, at_pg = args.get(spec.data), args["process_group"]
    at_async = args.get("async_op")
    p2p = spec.peer is not None or spec.op == "recv"
    more = "root_rank" in args or "input_split_sizes" in args
    name, coalesced = spec.op, spec.coalesced

    def kernel(keyset, *values, **kwargs):
        sink = _SINK
        depth = getattr(_INSIDE, "depth", 0)
        if sink is None or not sink.on or depth > 0:
            return redispatch(keyset & _BELOW, *values, **kwargs)
        n = len(values)
        if p2p:
            async_op = not _blocking_p2p()
        elif at_async is not None and at_async < n:
            async_op = bool(values[at_async])
        else:
            async_op = bool(kwargs.get("async_op", True))
        data = None
        if spec.data is not None:
            data = values[at_data] if at_data < n else kwargs.get(spec.data)
        if isinstance(data, torch.Tensor):
            tensors = [data]
        elif type(data) is list and all(map(_IS_TENSOR, data)):
            tensors = data  # the common case: a flat list (read, never changed)
        else:
            tensors = tensors_of(data)
        pg = _PG.unbox(values[at_pg] if at_pg < n else kwargs["process_group"])
        peer = _arg(args, values, kwargs, spec.peer) if p2p and spec.peer else None
        if _UNSEEN:
            poll_now(sink.now)
        fields = _fields(_bind(args, values, kwargs)) if more else None
        if _LOGICAL is not None:  # an emulated op: recorded as the one the program asked for
            tensors, fields = _LOGICAL
        event = sink.launch(name, tensors, pg, peer, async_op, coalesced, fields)
        _INSIDE.depth = 1  # an op the real kernel calls is part of this one (see _run)
        try:
            out = redispatch(keyset & _BELOW, *values, **kwargs)
        finally:
            _INSIDE.depth = 0
        hold_work(_Work.unbox(out[1] if isinstance(out, tuple) else out), event)
        return out
    return kernel


@contextlib.contextmanager
def logical(tensors: list, fields: dict | None):
    """Record the collectives launched inside as ``tensors`` with ``fields``: a patch that runs
    a collective the backend refuses in another form (an uneven all-gather padded, on gloo)
    keeps the record what the program issued."""
    global _LOGICAL
    saved, _LOGICAL = _LOGICAL, (tensors, fields)
    try:
        yield
    finally:
        _LOGICAL = saved


def _fields(bound: dict) -> dict | None:
    """What else must agree across the ranks of a collective: the root (a group rank here; the
    recorder makes it global) and all-to-all split sizes (empty: equal parts)."""
    fields = None
    if "root_rank" in bound:
        fields = {"root": bound["root_rank"]}
    if bound.get("input_split_sizes"):
        fields = {"input_splits": list(bound["input_split_sizes"]),
                  "output_splits": list(bound.get("output_split_sizes") or [])}
    return fields


def _functional_kernel(keyset, *values, _op, _spec: OpSpec | None, _args, _name, **kwargs):
    sink = _SINK
    if sink is None or not sink.on or _inside():
        return _op.redispatch(keyset & _BELOW, *values, **kwargs)
    bound = _bind(_args, values, kwargs)
    if _name == "wait_tensor":
        return timed_wait(bound["tensor"], partial(_op.redispatch, keyset & _BELOW, *values,
                                                    **kwargs))
    pg = c10d._resolve_process_group(bound["group_name"])
    if _name == "batch_p2p_ops":
        events = [sink.launch("send" if kind == "isend" else "recv", [t], pg, peer, True, False)
                  for kind, peer, t in zip(bound["op_list"], bound["peer_list"],
                                           bound["tensors"], strict=True)]
    else:
        peer = bound.get(_spec.peer) if _spec.peer else None
        events = [sink.launch(_spec.op, tensors_of(bound[_spec.data]), pg, peer, True,
                              _spec.coalesced)]
    out = _run(_op, keyset, values, kwargs)
    outputs = out if isinstance(out, (list, tuple)) else [out]
    for i, tensor in enumerate(outputs):
        event = events[i] if len(events) == len(outputs) else events[0]
        hold_output(tensor, event)
    return out


