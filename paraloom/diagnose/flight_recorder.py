"""PyTorch Flight Recorder dumps read as diagnosis evidence (``paraloom diagnose DIR``).

A folder of dumps, one file per rank, whatever the prefix (``TORCH_FR_DUMP_TEMP_FILE``'s
``nccl_trace_rank_3``, or ``fr_3``): the rank is the number that ends the file's name. A dump is
the pickle ``torch._C._distributed_c10d._dump_fr_trace()`` returns (or its JSON form,
``_dump_fr_trace_json()``): ``pg_config`` (process group name -> its ranks), ``pg_status``
(per group id, the last enqueued, started and completed collective) and ``entries``, one per
operation, in launch order, with ``collective_seq_id`` (position in its group), the op
(``profiling_name``: ``gloo:all_reduce``, ``nccl:send 0->1``), input sizes and dtypes, state
and the Python frames that launched it.

What is read, and how:

* each entry becomes an event of the ledger's form: op, shape, dtype and bytes of its first
  input, the group's global ranks, ``gseq`` from ``collective_seq_id`` (so members are matched
  by position, not time), and ``site``: the innermost frame outside torch (``file:line
  function``; torch and decorators' wrappers skipped). Phase and module are not in a dump.
* the default group is named ``''`` in ``pg_config`` and ``'0'`` in the entries (gloo, torch
  2.13): they are the same group (FR's own analyser fails on this with ``KeyError: ('0', 3)``).
  Groups made by ``new_group`` are missing from gloo's ``pg_config`` (and overwrite the ``''``
  entry with no ranks): a group whose ranks no dump names is taken to span every rank, and the
  diagnosis says so in a note.
* completion: an entry is done when its state says ``completed``, or when its position is at
  most the group's ``last_completed_collective`` in ``pg_status`` (gloo reports every state as
  ``scheduled`` but keeps the status); when neither tells, completion is unknown and a rank's
  last entry may be waiting or done.
* a rank without a dump (gloo aborts a rank whose collective fails, before any dump) has no
  events; the diagnosis says so. Gloo's dumps hold no send/recv at all, so a p2p hang leaves
  nothing to compare there.

:class:`~paraloom.run_folder.RunFolderError` names the file when a dump cannot be read.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path

from ..run_folder import LEDGER, RunFolderError, element_bytes, files_by_rank, rank_ledgers
from .evidence import Evidence, RankEvidence, load, number

__all__ = ["dump_files", "load_dumps", "load_any", "event_of"]

_OPS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
        "allgather": "all_gather", "_allgather_base": "all_gather",
        "all_gather_into_tensor": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
        "reduce_scatter_tensor_coalesced": "reduce_scatter", "alltoall": "all_to_all",
        "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all"}
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool"}
_RANK = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")


def dump_files(folder: Path) -> dict[int, Path]:
    """The files of ``folder`` whose name ends with a rank number (``fr_3``, ``x_rank_3.json``)."""
    return files_by_rank(folder, _RANK)


def _read(path: Path) -> dict:
    data = path.read_bytes()
    try:
        dump = pickle.loads(data)
    except Exception:  # noqa: BLE001 -- a JSON dump, or not a dump at all
        try:
            dump = json.loads(data.decode())
        except (UnicodeDecodeError, ValueError):
            raise RunFolderError(f"{str(path)!r} is neither a pickled nor a JSON Flight "
                                 f"Recorder dump") from None
    if not isinstance(dump, dict) or "entries" not in dump or "pg_config" not in dump:
        raise RunFolderError(f"{str(path)!r} is not a Flight Recorder dump (no 'entries' and "
                             f"'pg_config')")
    return dump


def _ranks(config: dict, name: str) -> list[int] | None:
    pg = config.get(name)
    if pg is None and name == "0":  # the default group: '' in pg_config, '0' in the entries
        pg = config.get("")
    if pg is None:
        return None
    ranks = pg.get("ranks")
    return json.loads(ranks) if isinstance(ranks, str) else list(ranks or [])


_NOT_THE_CALLER = ("/torch/", "\\torch\\", "typing_extensions.py", "/contextlib.py",
                   "/functools.py", "/warnings.py", "<frozen")
"""Frames that are not where a program communicates: torch itself, and decorators' wrappers
(torch's deprecation warnings wrap ``all_gather_into_tensor`` in ``typing_extensions``)."""


def _site(frames) -> str | None:
    for frame in frames or []:
        name = str(frame.get("filename", ""))
        if not any(part in name for part in _NOT_THE_CALLER):
            return f"{name}:{frame.get('line')} {frame.get('name')}"
    return None


def event_of(rank: int, index: int, entry: dict, config: dict, status: dict
             ) -> tuple[dict, bool]:
    """One dump entry as a ledger event, and whether its completion is known."""
    kind, _, rest = str(entry.get("profiling_name", "")).partition(":")
    name, _, pair = rest.strip().partition(" ")
    op = _OPS.get(name, name or kind)
    pg_name, desc = (list(entry.get("process_group") or ("", "")) + ["", ""])[:2]
    sizes, dtypes = entry.get("input_sizes") or [], entry.get("input_dtypes") or []
    shape = list(sizes[0]) if sizes else None
    dtype = _DTYPES.get(dtypes[0], str(dtypes[0]).lower()) if dtypes else None
    nbytes = math.prod(shape) * element_bytes(dtype) if shape is not None else 0
    group = _ranks(config, str(pg_name)) or []
    e = {"rank": rank, "seq": index, "step": 1, "microbatch": 0, "phase": None,
         "kind": "world" if desc == "default_pg" else
         (desc if desc not in ("", "undefined") else f"pg {pg_name}"), "op": op,
         "site": _site(entry.get("frames")), "module": None, "split": None, "async": False,
         "bytes": nbytes, "shape": shape, "dtype": dtype, "group": group, "pg": str(pg_name)}
    created = (entry.get("time_created_ns") or 0) / 1e9  # host seconds (epoch): see load_dumps
    done = (entry.get("time_discovered_completed_ns") or 0) / 1e9
    e["t_start"] = e["t_wait"] = created
    e["t_end"] = max(done, created)
    seq = entry.get("collective_seq_id")
    if entry.get("is_p2p") or op in ("send", "recv"):
        m = re.match(r"(\d+)->(\d+)", pair)
        if m:
            src, dst = int(m.group(1)), int(m.group(2))
            e["peer"] = dst if op == "send" else src
    elif seq is not None:
        e["gseq"] = int(seq) - 1
    state = entry.get("state")
    last = (status.get(str(entry.get("pg_id"))) or {}).get("last_completed_collective")
    if state == "completed" or (last is not None and seq is not None and 0 < seq <= last):
        return e, True
    known = state in ("started",) or last is not None
    e["pending"] = True
    return e, known


def load_dumps(folder: Path) -> Evidence:
    """The evidence of a folder of Flight Recorder dumps (:class:`RunFolderError` naming the
    folder or the file when there is none or one is not a dump)."""
    files = dump_files(folder)
    if not files:
        raise RunFolderError(f"{str(folder)!r} holds no ledger and no Flight Recorder dump "
                             f"(files named ..._RANK): give a paraloom record or train run, "
                             f"or the folder of a job's FR dumps")
    ranks: dict[int, RankEvidence] = {}
    known, world = True, 0
    for rank, path in files.items():
        dump = _read(path)
        config, status = dump.get("pg_config") or {}, dump.get("pg_status") or {}
        events = []
        for i, entry in enumerate(dump.get("entries") or []):
            e, sure = event_of(rank, i, entry, config, status)
            events.append(e)
            known = known and sure
        ranks[rank] = RankEvidence(rank, events)
        world = max([world, rank + 1] + [len(_ranks(config, n) or []) for n in config])
    notes = []
    assumed = sorted({e["pg"] for ev in ranks.values() for e in ev.events if not e["group"]})
    t0 = min((e["t_start"] for ev in ranks.values() for e in ev.events), default=0.0)
    for ev in ranks.values():
        for e in ev.events:
            e["group"] = e["group"] or list(range(world))
            for key in ("t_start", "t_wait", "t_end"):  # seconds since the first entry
                e[key] -= t0
        ev.events = number(ev.events)
    if assumed:
        notes.append(f"the dumps do not say which ranks are in process group"
                     f"{'s' if len(assumed) > 1 else ''} {', '.join(assumed)} (gloo's pg_config "
                     f"leaves out groups made by new_group): taken to span all {world} ranks")
    for r in range(world):
        if r not in ranks:
            ranks[r] = RankEvidence(r, missing="no Flight Recorder dump (gloo aborts a rank "
                                               "whose collective fails before it dumps)")
            notes.append(f"rank {r} left no Flight Recorder dump in {str(folder)!r}")
    if any(not ev.events for ev in ranks.values() if ev.missing is None):
        notes.append("a dump without entries: gloo's Flight Recorder records no send/recv")
    return Evidence(dict(sorted(ranks.items())), "flight-recorder", folder,
                    completion_known=known, notes=notes)


def load_any(folder: str | Path) -> Evidence:
    """The evidence in ``folder``: a paraloom run's ledgers, or else Flight Recorder dumps."""
    folder = Path(folder)
    if folder.is_dir() and not rank_ledgers(folder) and not (folder / LEDGER).is_file():
        return load_dumps(folder)
    return load(folder)
