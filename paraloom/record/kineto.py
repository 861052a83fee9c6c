"""PyTorch profiler (Kineto) Chrome traces read as ledger events (``paraloom import``).

A job profiled with ``torch.profiler`` (``record_shapes=True``) and exported per rank with
``export_chrome_trace`` already holds its communication; this reads it back:

* gloo, and the host side of any backend: the ``c10d::*`` CPU ops (``c10d::allreduce_``,
  ``c10d::_allgather_base_``, ``c10d::broadcast_``, ``c10d::send`` ...), in launch order, with
  their input dims and types (the op's tensor argument; a ``TensorList``'s type comes from the
  backend's own annotation of the same op, ``gloo:all_reduce``), the peer of a send/recv and the
  root of a broadcast from "Concrete Inputs";
* NCCL's ``record_param_comms`` events, by their documented fields: "Collective name", "In msg
  nelems", "dtype", "Process Group Name", "Process Group Ranks" (used instead of the c10d ops
  when present);
* the phase from the profiler's own annotations around the op: inside an autograd engine
  function ``backward``, inside ``Optimizer.step`` ``optimizer``, inside a module's or the
  program's forward ``forward`` when the trace says so, else ``unknown`` (and the import says
  that phases were not known).

The process group of a ``c10d::`` op is not in the trace: with one group
(``distributedInfo.pg_count``) it is the world; with several, the world is assumed and said.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

from ..run_folder import RunFolderError, element_bytes, files_by_rank

__all__ = ["trace_files", "read_trace", "events_of"]

_C10D = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
         "_allgather_base_": "all_gather", "allgather_": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
         "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "barrier": "barrier",
         "send": "send", "recv_": "recv", "recv_any_source_": "recv", "reduce_": "reduce",
         "gather_": "gather", "scatter_": "scatter"}
_INPUT = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
"""Index of the input tensor among the op's arguments (the output comes first there)."""
_NCCL = {"allreduce": "all_reduce", "all_reduce": "all_reduce", "allgather": "all_gather",
         "_allgather_base": "all_gather", "all_gather": "all_gather",
         "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
         "broadcast": "broadcast", "all_to_all": "all_to_all", "all_to_allv": "all_to_all",
         "send": "send", "recv": "recv", "barrier": "barrier"}
_TYPES = {"float": "float32", "double": "float64", "c10::Half": "float16", "half": "float16",
          "c10::BFloat16": "bfloat16", "long int": "int64", "int": "int32",
          "unsigned char": "uint8", "bool": "bool", "signed char": "int8", "short int": "int16",
          "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
          "Long": "int64", "Int": "int32", "Byte": "uint8", "Bool": "bool"}
_RANK = re.compile(r"(\d+)(?:\.pt)?\.(?:trace\.)?json(?:\.gz)?$")


def trace_files(folder: Path) -> dict[int, Path]:
    """``*RANK.json`` / ``*RANK.json.gz`` / ``*RANK.pt.trace.json`` files of ``folder``."""
    return files_by_rank(folder, _RANK)


def read_trace(path: Path) -> dict:
    """The Chrome trace in ``path`` (:class:`RunFolderError` naming it when it is not one)."""
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        trace = json.loads(text)
    except (OSError, ValueError, EOFError) as err:
        raise RunFolderError(f"{str(path)!r} is not a profiler trace (Chrome JSON): {err}") \
            from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise RunFolderError(f"{str(path)!r} is not a profiler trace (no traceEvents)")
    return trace


def _phase(event: dict, spans: list[dict]) -> str:
    t = event["ts"]
    inside = [s["name"] for s in spans if s["tid"] == event.get("tid")
              and s["ts"] <= t <= s["ts"] + s.get("dur", 0)]
    if any(n.startswith("autograd::engine::evaluate_function") for n in inside):
        return "backward"
    if any(n.startswith("Optimizer.step") for n in inside):
        return "optimizer"
    if any(n.startswith(("nn.Module:", "## forward", "forward")) for n in inside):
        return "forward"
    return "unknown"


def _dtype(text) -> str | None:
    return _TYPES.get(str(text), str(text) if text else None)


def _event(rank, op, shape, dtype, group, phase, site, span, t0, **extra) -> dict:
    nbytes = math.prod(shape) * element_bytes(dtype) if shape is not None else 0
    start, end = (span["ts"] - t0) / 1e6, (span["ts"] + span.get("dur", 0) - t0) / 1e6
    split = f"{dtype or 'tensor'} {shape}" if shape is not None else None
    return {"rank": rank, "seq": 0, "step": 1, "microbatch": 0, "phase": phase,
            "kind": "world", "op": op, "site": f"profiler:{site}", "module": None, "split": split,
            "async": False, "bytes": nbytes, "shape": shape, "dtype": dtype, "group": group,
            "t_start": start, "t_wait": start, "t_end": end, **extra}


def _annotation(marks: list[dict], used: set[int], ts: float, dims) -> dict | None:
    """The first unused backend annotation (``gloo:all_reduce``) at or after ``ts`` with the
    op's input dims (gloo runs some ops through others: a reduce-scatter is an all-reduce)."""
    for late in (True, False):
        for mark in marks:
            got = ((mark.get("args") or {}).get("Input Dims") or [None])[0]
            if id(mark) not in used and (mark["ts"] >= ts or not late) and got == dims:
                used.add(id(mark))
                return mark
    return None


def events_of(trace: dict, rank: int) -> tuple[list[dict], list[str]]:
    """The communication of one rank's trace as ledger events, and notes on what was assumed."""
    info = trace.get("distributedInfo") or {}
    world = list(range(int(info.get("world_size", 0)))) or None
    rows = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    rows.sort(key=lambda e: e["ts"])
    t0 = rows[0]["ts"] if rows else 0
    spans = [e for e in rows if e.get("name", "").startswith(
        ("autograd::engine::evaluate_function", "Optimizer.step", "nn.Module:", "## forward"))]
    nccl = [e for e in rows if e.get("name") == "record_param_comms"
            and (e.get("args") or {}).get("Collective name")]
    notes, events = [], []
    if nccl:
        for e in nccl:
            a = e["args"]
            op = _NCCL.get(a["Collective name"], a["Collective name"])
            ranks = a.get("Process Group Ranks")
            group = json.loads(ranks) if isinstance(ranks, str) else ranks
            events.append(_event(rank, op, [int(a.get("In msg nelems", 0))], _dtype(a.get("dtype")),
                                 group or world, _phase(e, spans), "record_param_comms", e, t0,
                                 pg=str(a.get("Process Group Name", ""))))
    else:
        annotated: dict[str, list[dict]] = {}
        for e in rows:
            if e.get("cat") == "user_annotation" and ":" in e.get("name", ""):
                annotated.setdefault(e["name"].split(":", 1)[1], []).append(e)
        used: set[int] = set()
        for e in rows:
            name = e.get("name", "")
            if e.get("cat") != "cpu_op" or not name.startswith("c10d::"):
                continue
            op = _C10D.get(name[len("c10d::"):])
            if op is None:
                continue
            a = e.get("args") or {}
            dims, types = a.get("Input Dims") or [], a.get("Input type") or []
            concrete = a.get("Concrete Inputs") or []
            i = _INPUT.get(op, 0)
            dim = dims[i] if i < len(dims) else None
            if dim and isinstance(dim[0], list):  # a TensorList: its first tensor
                dim = dim[0]
            dtype = _dtype(types[i]) if i < len(types) and types[i] != "TensorList" else None
            if dtype is None:  # the backend's annotation of the same op and dims, after it
                mark = _annotation(annotated.get(op, []), used, e["ts"], dim)
                if mark is not None:
                    dtype = _dtype((mark.get("args") or {}).get("Input type", [None])[0])
            extra = {}
            if op in ("send", "recv", "broadcast") and len(concrete) > 2 and concrete[2]:
                extra["peer" if op != "broadcast" else "root"] = int(concrete[2])
            events.append(_event(rank, op, list(dim) if dim is not None else None, dtype,
                                 world, _phase(e, spans), name, e, t0, **extra))
        if int(info.get("pg_count", 1)) > 1:
            notes.append(f"rank {rank}: {info.get('pg_count')} process groups, and a c10d op "
                         f"does not say which it ran on: every op is put on the world")
    for n, e in enumerate(events):
        e["seq"] = n
        if e["op"] == "barrier":  # gloo's barrier is a one-byte all-reduce: nothing of the job's
            e["shape"], e["dtype"], e["bytes"], e["split"] = None, None, 0, None
    if any(e["phase"] == "unknown" for e in events):
        notes.append(f"rank {rank}: phase unknown where the trace has no autograd, optimizer "
                     f"or module annotation around the op")
    return events, notes
