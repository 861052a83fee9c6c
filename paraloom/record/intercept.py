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
functional collectives are asynchronous (waited by ``wait_tensor``). Times: ``t_start`` at
launch; ``t_wait``/``t_end`` around ``Work.wait`` when Python waits (the Work is held so that
Python gets back the same object); for Works waited in C++ (DDP), ``t_end`` is the first time
the recorder saw the Work completed (polled at the next launch and at the optimizer step: an
upper bound) and ``t_wait`` equals it. On CUDA every stamp is a CUDA event on the current
stream from the program's first CUDA collective on (``Ledger.use_device_clock``): ``t_start``
when the device reaches the launch, ``t_end`` when it reaches the point after the wait (a
Work's wait orders the stream; the host returns earlier), resolved into seconds when the
recorder rewrites its lines at a step boundary (waiting for those events only).
"""

from __future__ import annotations

import sys
import threading
import time
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from .ops import C10D, FUNCTIONAL, OpSpec, tensors_of

__all__ = ["install", "uninstall", "prune", "poll", "installed"]

_KEYS = ("ADInplaceOrView",)
_BELOW = torch._C._after_ADInplaceOrView_keyset
_Work = torch._C._distributed_c10d.Work
_PG = torch._C._distributed_c10d.ProcessGroup
_ORIG_WAIT = _Work.wait
_ORIG_FUNCOL_WAIT = funcol.wait_tensor
_C10D_FILE = c10d.__file__
_BLOCKING_P2P = ("send", "recv")

_SINK = None  # the active recorder: .on, .now(), .launch(op, tensors, pg, peer, async_op, ...)
_LIBS: list = []
_WORKS: dict[int, list] = {}  # id(Work) -> [Work, event, 0 | 1 waited | 2 seen complete]
_TENSORS: dict[int, list] = {}  # data_ptr of a functional output -> [tensor, event, waited]
_INSIDE = threading.local()  # .depth > 0 while a recorded op runs (its kernel may call others)


def installed() -> bool:
    return bool(_LIBS)


def install(sink) -> None:
    """Register the kernels and route what they see to ``sink`` (one sink per process)."""
    global _SINK
    if _LIBS:
        raise RuntimeError("paraloom record: a recorder is already active in this process "
                           "(record_comms blocks cannot nest)")
    _SINK = sink
    for ns, table, kernel in (("c10d", C10D, _c10d_kernel),
                              ("_c10d_functional", FUNCTIONAL, _functional_kernel)):
        lib = torch.library.Library(ns, "IMPL")
        packet = getattr(torch.ops, ns)
        names = list(table) + (["batch_p2p_ops"] if ns != "c10d" else [])
        for name in names:
            op = getattr(packet, name).default
            args = [a.name for a in op._schema.arguments]
            fn = partial(kernel, _op=op, _spec=table.get(name), _args=args, _name=name)
            for key in _KEYS:
                lib.impl(name, fn, key, with_keyset=True)
        _LIBS.append(lib)
    _Work.wait = _observed_wait
    funcol.wait_tensor = _observed_wait_tensor


def uninstall() -> None:
    """Remove the kernels (the real ones are back) and forget pending Works."""
    global _SINK
    for lib in _LIBS:
        lib._destroy()
    _LIBS.clear()
    _Work.wait = _ORIG_WAIT
    funcol.wait_tensor = _ORIG_FUNCOL_WAIT
    _SINK = None
    _WORKS.clear()
    _TENSORS.clear()


def prune() -> None:
    """Drop finished Works and all functional outputs (called at optimizer steps): the holds
    only exist to match a later wait, and must not keep tensors alive across steps."""
    if _SINK is not None:
        _poll(_SINK.now)
    for key, entry in list(_WORKS.items()):
        if entry[2]:
            del _WORKS[key]
    for entry in _TENSORS.values():  # never waited: done by now (DTensor waits what it uses)
        entry[1].pop("pending", None)
    _TENSORS.clear()


def _bind(args: list, values: tuple, kwargs: dict) -> dict:
    bound = dict(zip(args, values, strict=False))
    bound.update(kwargs)
    return bound


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


def _c10d_kernel(keyset, *values, _op, _spec: OpSpec, _args, _name, **kwargs):
    sink = _SINK
    if sink is None or not sink.on or _inside():
        return _op.redispatch(keyset & _BELOW, *values, **kwargs)
    bound = _bind(_args, values, kwargs)
    if _spec.peer is not None or _spec.op == "recv":
        async_op = not _blocking_p2p()
    else:
        async_op = bool(bound.get("async_op", True))
    tensors = tensors_of(bound[_spec.data]) if _spec.data else []
    pg = _PG.unbox(bound["process_group"])
    peer = bound.get(_spec.peer) if _spec.peer else None
    if _WORKS:
        _poll(sink.now)
    event = sink.launch(_spec.op, tensors, pg, peer, async_op, _spec.coalesced,
                        _fields(bound))
    out = _run(_op, keyset, values, kwargs)
    work = _Work.unbox(out[1] if isinstance(out, tuple) else out)
    entry = [work, event, False]
    _WORKS[id(work)] = entry
    return out


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


def settle(patience_s: float = 0.5) -> None:
    """At the end of a record: give Works still in flight a moment to complete, so that a
    healthy program ends with nothing ``pending`` (what :mod:`paraloom.diagnose` reads)."""
    deadline = time.monotonic() + patience_s
    while _SINK is not None and _WORKS:
        _poll(_SINK.now)
        if all(entry[2] for entry in _WORKS.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.01)


def poll() -> None:
    """:func:`_poll` on the active recorder's clock (called when an optimizer step starts)."""
    if _SINK is not None and _WORKS:
        _poll(_SINK.now)


def _poll(now) -> None:
    """Give Works nobody waited on from Python (DDP's reducer waits in C++) the first time they
    are seen complete as their end. Polled at each launch and optimizer step, not by a future
    callback: that would run Python on the backend's worker thread, which then queues for the
    GIL while the next collectives wait behind it (measured: DDP steps 15-30% slower)."""
    t = None
    for entry in _WORKS.values():
        if not entry[2] and entry[0].is_completed():
            t = now() if t is None else t
            entry[1]["t_wait"] = entry[1]["t_end"] = t
            if not _succeeded(entry[0]):
                entry[1]["failed"] = True
            if _SINK is not None:
                _SINK.completed(entry[1])
            entry[2] = 2  # seen complete; a later Python wait still times itself


def _succeeded(work) -> bool:
    try:
        return work.is_success()
    except RuntimeError:  # torch asks for completion first on some backends
        return True


def _observed_wait(self, *args, **kwargs):
    entry = _WORKS.pop(id(self), None)
    sink = _SINK
    if entry is None or sink is None or entry[0] is not self:
        return _ORIG_WAIT(self, *args, **kwargs)
    event = entry[1]
    event["t_wait"] = sink.now()
    entry[2] = 1
    try:
        return _ORIG_WAIT(self, *args, **kwargs)
    except BaseException:
        event["failed"] = True  # gloo raised: a peer went away or sent something else
        raise
    finally:
        event["t_end"] = sink.now()
        sink.completed(event)


def _functional_kernel(keyset, *values, _op, _spec: OpSpec | None, _args, _name, **kwargs):
    sink = _SINK
    if sink is None or not sink.on or _inside():
        return _op.redispatch(keyset & _BELOW, *values, **kwargs)
    bound = _bind(_args, values, kwargs)
    if _name == "wait_tensor":
        return _timed_wait(bound["tensor"], partial(_op.redispatch, keyset & _BELOW, *values,
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
        _TENSORS[tensor.data_ptr()] = [tensor, event, False]
    return out


def _timed_wait(tensor, wait):
    """Run ``wait()`` for a functional output, timing it if it is a recorded one."""
    entry = _TENSORS.pop(tensor.data_ptr(), None)
    sink = _SINK
    if entry is None or sink is None:
        return wait()
    if not entry[2]:
        entry[1]["t_wait"] = sink.now()
        entry[2] = True
    try:
        return wait()
    finally:
        entry[1]["t_end"] = sink.now()
        sink.completed(entry[1])


def _observed_wait_tensor(tensor):
    """``funcol.wait_tensor``, which DTensor's AsyncCollectiveTensor calls from inside its own
    ``__torch_dispatch__`` (autograd keys excluded there, so the dispatcher kernel misses it):
    timed here so those waits get their ``t_wait``/``t_end`` too."""
    return _timed_wait(tensor, partial(_ORIG_FUNCOL_WAIT, tensor))
