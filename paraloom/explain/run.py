"""``paraloom explain FILE --run DIR``: the static reading of FILE next to what a run recorded.

A recorded event (``paraloom record``) names its ``site`` as ``path/file.py:LINE function``: the
innermost frame outside torch and paraloom that called the communication. An event belongs to
a static site of FILE when its path is FILE and its line lies in the site's statement (a call
spread over several lines is one statement); sites at the same statement are told apart by op.

Only *direct* sites (a ``torch.distributed`` call written in FILE) can receive events: a site
reached through helpers of FILE (``via``) points at the direct site its chain ends in, where its
events are counted (when the static reading merged several paths into one site, no single line
is named), and a region helper defined elsewhere (Megatron's ``*_region``) communicates in its
own file, so its events carry that file's site -- unless that file is torch's: the recorder
names the innermost frame outside torch, so a DTensor plan's collectives (``ColwiseParallel``)
carry the line of FILE that ran the module (its forward call, ``backward()``); they are given to
the plan's site by op and phase. Recorded events in FILE (and in the snippet's line range) that
no site takes are listed as *missed by the static reading* -- unless FILE wraps a module in one
of torch's data-parallel wrappers (``DistributedDataParallel``/``DDP``, ``fully_shard``, FSDP):
their collectives are torch's (its reducer, FSDP's hooks), recorded at the line of FILE that ran
them, and are listed as *inside torch's wrapper*, with the line that wrapped the module.

Per site and rank: count, phase, async, bytes and the order index ``#k`` (position in that
rank's communication sequence, compute spans excluded — the index ``paraloom diff`` prints).
A ``paraloom train`` run names no source lines: its events carry paraloom's labels
(``ColumnParallelLinear.forward:input``, ``finalize_model_grads:embedding_grads``). A label whose
owner (its first dotted name) is a class or function defined in FILE is matched to FILE's static
sites of that owner with the event's op and phase (:func:`_by_label`): the candidates are named,
since a label does not say which of several such lines ran. Labels owned elsewhere are counted.

The result is data; :func:`paraloom.report.explain_text.render_run` writes it as text.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ..run_folder import RunFolderError, load_events
from .source import SourceError, load_snippet, parse_snippet

__all__ = ["parse_site", "annotate"]

_SITE = re.compile(r"^(?P<path>.+?):(?P<line>\d+)(?:\s+(?P<func>\S.*))?$")


def parse_site(site: str | None) -> tuple[str, int, str | None] | None:
    """``"a/b.py:12 C.f"`` -> ``("a/b.py", 12, "C.f")``; ``None`` for paraloom's own labels
    (``"ColumnParallelLinear.backward:input_grad"``) and anything without ``path:LINE``."""
    m = _SITE.match(site or "")
    return (m["path"], int(m["line"]), m["func"]) if m else None


def _same_file(recorded: str, file: Path) -> bool:
    """The recorded path is FILE: equal after resolving, or a relative tail of it."""
    rec = Path(recorded)
    if rec.is_absolute():
        return rec.resolve() == file
    return file.parts[-len(rec.parts):] == rec.parts or (Path.cwd() / rec).resolve() == file


def _statements(tree: ast.Module) -> list[tuple[int, int]]:
    """Line range of every statement; a compound statement counts only its header lines."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            end = (max(node.lineno, body[0].lineno - 1) if isinstance(body, list) and body
                   and isinstance(body[0], ast.stmt) else node.end_lineno or node.lineno)
            out.append((node.lineno, end))
    return out


def _functions(tree: ast.Module) -> dict[str, tuple[int, int]]:
    """``"f"`` / ``"Class.f"`` -> line range of each function (the names ``via`` uses)."""
    out = {}
    for node in tree.body:
        inner = node.body if isinstance(node, ast.ClassDef) else [node]
        for fn in inner:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{node.name}.{fn.name}" if node is not fn else fn.name
                out[name] = (fn.lineno, fn.end_lineno or fn.lineno)
    return out


_WRAPPERS = {"DistributedDataParallel": "DistributedDataParallel", "DDP": "DistributedDataParallel",
             "fully_shard": "fully_shard", "FullyShardedDataParallel": "FullyShardedDataParallel",
             "FSDP": "FullyShardedDataParallel"}
"""torch's data-parallel wrappers by the names a program calls them."""
_FSDP_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
_WRAPPER_OPS = {"DistributedDataParallel": ("all_reduce", "broadcast", "all_gather"),
                "fully_shard": _FSDP_OPS, "FullyShardedDataParallel": _FSDP_OPS}
"""What each wrapper issues: DDP's reducer all-reduces buckets, its constructor broadcasts and
gathers; the FSDPs all-gather and reduce-scatter (all-reduce under hybrid sharding, broadcast
to sync module states)."""


def _wrappers(tree: ast.Module) -> dict[str, int]:
    """torch's wrapper -> the first line of FILE that calls it (``DDP(model)``)."""
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in _WRAPPERS:
                out.setdefault(_WRAPPERS[name], node.lineno)
    return out


def _wrapped_by(event: dict, wrappers: dict[str, int]) -> str | None:
    """Which of FILE's torch wrappers issues ``event`` (``None``: none could): of those that
    issue its op, the last one wrapped at or before its line (else the first)."""
    able = sorted((line, name) for name, line in wrappers.items()
                  if event["op"] in _WRAPPER_OPS[name])
    if not able:
        return None
    line, name = ([a for a in able if a[0] <= event["line"]] or able[:1])[-1]
    return f"{name} (line {line})"


def _range_of(line: int, stmts: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest statement range holding ``line``."""
    inside = [r for r in stmts if r[0] <= line <= r[1]]
    return min(inside, key=lambda r: r[1] - r[0]) if inside else (line, line)


def _load(run_dir: str) -> list[dict]:
    """The run's communication events (no compute spans), ordered by (rank, seq)."""
    try:
        events = load_events(run_dir)
    except (RunFolderError, OSError) as err:
        raise SourceError(f"--run {run_dir!r}: {err}") from None
    return sorted((e for e in events if e["op"] != "compute"),
                  key=lambda e: (e["rank"], e.get("seq", 0)))


def annotate(facts: dict, run_dir: str, rank: int | None = 0) -> dict:
    """Mark ``facts["sites"]`` with the recorded events of ``run_dir`` (``rank``; ``None`` for
    every rank); returns ``{"dir", "rank", "ranks", "sites": [...], "missed": [...]}`` where each
    site entry is ``{"site": index in facts["sites"], "line", "range", "events": [...]}``."""
    if facts["file"] == "-":
        raise SourceError("--run needs a file path (recorded sites name files), not stdin")
    file = Path(facts["file"]).resolve()
    events = _load(run_dir)
    ranks = sorted({e["rank"] for e in events})
    if rank is not None and rank not in ranks:
        raise SourceError(f"--rank {rank}: the run in {run_dir!r} has ranks {ranks}")
    tree = parse_snippet(load_snippet(str(file)))
    stmts, funcs = _statements(tree), _functions(tree)
    first, last = facts["lines"]
    order: dict[int, int] = {}
    here = []  # (event, line) of events recorded in FILE
    files: dict[str, int] = {}  # recorded site files of the shown ranks (for a hint)
    labelled = []  # events that name a label, not a line (a paraloom train run)
    for e in events:  # communication events only, in (rank, seq) order
        order[e["rank"]] = order.get(e["rank"], -1) + 1
        where = parse_site(e.get("site"))
        if where is None and (rank is None or e["rank"] == rank):
            labelled.append(dict(e, index=order[e["rank"]]))
        if where and (rank is None or e["rank"] == rank):
            files[where[0]] = files.get(where[0], 0) + 1
        if where and (rank is None or e["rank"] == rank) and _same_file(where[0], file) \
                and first <= where[1] <= last:
            here.append((dict(e, index=order[e["rank"]], line=where[1], function=where[2]),
                         where[1]))
    direct = [(i, s, _range_of(s["line"], stmts)) for i, s in enumerate(facts["sites"])
              if not s["via"]]
    marks = {i: {"site": i, "line": s["line"], "range": list(r), "events": []}
             for i, s, r in direct}
    missed = []
    for e, line in here:
        at = [(i, s) for i, s, r in direct if r[0] <= line <= r[1]]
        same_op = [i for i, s in at if s["op"] == e["op"]]
        if at:
            marks[(same_op or [at[0][0]])[0]]["events"].append(e)
        else:
            missed.append(e)
    via = []
    for i, s in enumerate(facts["sites"]):
        if not s["via"]:
            continue
        span, inner = funcs.get(s["via"][-1]), s.get("inner_line")
        to = None  # the direct site the helper chain ends in, when it is one path in FILE
        if span and inner and span[0] <= inner <= span[1]:
            to = next((j for j, d, r in direct if r[0] <= inner <= r[1] and d["op"] == s["op"]),
                      None)
        entry = {"site": i, "line": s["line"], "to": to, "events": [],
                 "elsewhere": None if span else s["via"][-1]}
        if entry["elsewhere"]:  # e.g. DTensor's ColwiseParallel: torch's code communicates, and
            # the recorded site is the line of FILE that ran it (a module's forward, backward())
            entry["events"] = [e for e in missed if (e["op"], e["phase"]) == (s["op"], s["phase"])]
            missed = [e for e in missed if not any(e is c for c in entry["events"])]
        via.append(entry)
    wrappers = _wrappers(tree)
    inside = [dict(e, wrapper=w) for e in missed if (w := _wrapped_by(e, wrappers))]
    missed = [e for e in missed if not _wrapped_by(e, wrappers)]
    by_label, elsewhere = _by_label(labelled, facts["sites"], _owners(tree, first, last))
    return {"dir": run_dir, "rank": rank, "ranks": ranks, "sites": list(marks.values()),
            "via": via, "missed": missed, "inside": inside, "files": files,
            "matched": len(here), "labels": by_label, "labels_elsewhere": elsewhere}


def _owners(tree: ast.Module, first: int, last: int) -> set[str]:
    """The classes and top-level functions defined in FILE's shown lines."""
    return {node.name for node in tree.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.lineno <= last and (node.end_lineno or node.lineno) >= first}


def _by_label(events: list[dict], sites: list[dict], owners: set[str]) -> tuple[list[dict], int]:
    """Label events whose owner is defined in FILE, grouped by (label, op, phase), each with the
    static sites it may be (``candidates``: their indices in ``sites``); and how many label
    events FILE does not own."""
    groups: dict[tuple, dict] = {}
    elsewhere = 0
    for e in events:
        label = e.get("site") or ""
        owner = label.partition(":")[0].split(".")[0]
        if owner not in owners:
            elsewhere += 1
            continue
        key = (label, e["op"], e["phase"])
        if key not in groups:
            groups[key] = {"label": label, "op": e["op"], "phase": e["phase"], "events": [],
                           "candidates": [i for i, s in enumerate(sites)
                                          if owner in (s.get("class"), s.get("function"))
                                          and s["op"] == e["op"]
                                          and s["phase"] in (e["phase"], "unknown")]}
        groups[key]["events"].append(dict(e, line=None, function=label))
    return list(groups.values()), elsewhere
