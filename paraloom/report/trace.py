"""Chrome / Perfetto trace JSON from a ledger: compute and communication per rank on a timeline.

Layout (open ``trace.json`` in ui.perfetto.dev or chrome://tracing):

* one process per rank (``pid`` = rank, named ``rank N`` by a ``process_name`` metadata event);
* in each, thread 0 ``compute`` (the GEMM and pipeline-step spans) and one thread per
  communication kind (``tp``, ``sp``, ``pp``, ``dp``, ``emb``, ...), named by ``thread_name``;
* synchronous operations and compute spans are complete events (``"ph": "X"``);
* an asynchronous operation is an async span (``"ph": "b"`` at launch, ``"e"`` at completion,
  category ``async``, id ``rank:seq``) — these may overlap each other and the compute, which is
  what the picture is for — plus an instant mark (``"ph": "i"``) on its kind's thread when its
  ``wait()`` began.

Times are microseconds from the run's start (the ledger's seconds times 1e6). Every event keeps
its ledger fields in ``args``.

    paraloom trace RUN_DIR       # (re)builds RUN_DIR/trace.json from RUN_DIR/ledger.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["build_trace", "write_trace", "KIND_ORDER"]

KIND_ORDER = ("tp", "sp", "cp", "pp", "dp", "emb", "mp", "distopt", "loss")
"""Thread order of the communication kinds (thread ``i + 1``); other kinds follow."""
_ARGS = ("step", "microbatch", "phase", "kind", "op", "site", "module", "split", "async",
         "bytes", "shape", "dtype", "group", "seq", "recompute", "bucket", "peer")


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _name(event: dict) -> str:
    if event["op"] == "compute":
        return event["site"]
    return f"{event['op']} {event['site']}" + (" (recompute)" if event.get("recompute") else "")


def build_trace(events: list[dict]) -> dict:
    """The trace as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    kinds = list(KIND_ORDER) + sorted({e["kind"] for e in events if e["op"] != "compute"}
                                      - set(KIND_ORDER))
    tid = {k: i + 1 for i, k in enumerate(kinds)}
    out: list[dict] = []
    for rank in sorted({e["rank"] for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        used = {"compute"} | {e["kind"] for e in events
                              if e["rank"] == rank and e["op"] != "compute"}
        for name, t in [("compute", 0)] + [(k, tid[k]) for k in kinds]:
            if name in used:
                out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": t,
                            "args": {"name": name}})
                out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": t,
                            "args": {"sort_index": t}})
    for e in sorted(events, key=lambda e: (e["rank"], e["t_start"], e["seq"])):
        compute = e["op"] == "compute"
        base = {"name": _name(e), "pid": e["rank"], "tid": 0 if compute else tid[e["kind"]],
                "cat": "compute" if compute else e["kind"],
                "args": {k: e[k] for k in _ARGS if k in e}}
        start, end = _us(e["t_start"]), _us(max(e["t_end"], e["t_start"]))
        if compute or not e["async"]:
            out.append({**base, "ph": "X", "ts": start, "dur": round(end - start, 3)})
            continue
        ident = f"{e['rank']}:{e['seq']}"
        out.append({**base, "ph": "b", "cat": "async", "id": ident, "ts": start})
        out.append({"name": base["name"], "pid": e["rank"], "tid": base["tid"], "ph": "e",
                    "cat": "async", "id": ident, "ts": end})
        out.append({"name": f"wait {e['op']}", "pid": e["rank"], "tid": base["tid"], "ph": "i",
                    "s": "t", "ts": _us(e.get("t_wait", e["t_end"])), "cat": e["kind"],
                    "args": {"seq": e["seq"]}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(events: list[dict], path: str | Path) -> Path:
    """Write :func:`build_trace` of ``events`` to ``path`` as JSON; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(build_trace(events)))
    return path
