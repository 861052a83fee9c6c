"""What a diagnosis reads: per rank, its events in launch order and how the rank ended.

From a run folder (``record`` or ``train``; finished, failed or killed) the events are the
per-rank ledgers as written, with a blocked rank's ``rank_R.tail.jsonl`` laid over them (its
version of an event wins: it carries the ``pending`` marks), or the merged ``ledger.jsonl`` when
the per-rank files are gone; how each rank ended comes from ``rank_R.status.json`` (record), the
launcher's ``failure.json`` (train) and the heartbeats. Old ledgers without sequence numbers get
them here, counted in launch order per process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..heartbeat import read_live
from ..run_folder import (
    LEDGER,
    LEDGER_DIR,
    RunFolderError,
    from_one,
    rank_ledgers,
    rank_status,
    rank_tail,
    read_json,
    read_json_lines,
    read_ledger,
)

__all__ = ["RankEvidence", "Evidence", "load", "number"]


@dataclass
class RankEvidence:
    """One rank: ``events`` (communication only, launch order), ``exit`` (``None``: still
    running or unknown; negative: killed by that signal), ``error`` (the line it raised),
    ``time`` (when it ended, host seconds), ``stopped`` (ended by the launcher, not by itself),
    ``missing`` (what the rank did not leave, e.g. "no Flight Recorder dump (...)")."""

    rank: int
    events: list[dict] = field(default_factory=list)
    exit: int | None = None
    error: str | None = None
    time: float | None = None
    stopped: bool = False
    live: dict | None = None
    missing: str | None = None


@dataclass
class Evidence:
    """Every rank's evidence, and where it came from (``source``: ``record`` / ``train`` /
    ``flight-recorder``); ``completion_known`` is ``False`` for gloo FR dumps (state is always
    ``scheduled``)."""

    ranks: dict[int, RankEvidence]
    source: str
    folder: Path
    completion_known: bool = True
    notes: list[str] = field(default_factory=list)


def number(events: list[dict]) -> list[dict]:
    """Give events without ``gseq``/``pseq`` their numbers (launch order per group / pair)."""
    groups: dict = {}
    pairs: dict = {}
    for e in events:
        if "gseq" in e or "pseq" in e or e.get("op") == "compute":
            continue
        key = (e.get("pg"), tuple(e.get("group") or ()))
        if e["op"] in ("send", "recv") and e.get("peer") is not None:
            pair = (e.get("pg"), e["rank"], e["peer"]) if e["op"] == "send" \
                else (e.get("pg"), e["peer"], e["rank"])
            e["pseq"] = pairs.get(pair, 0)
            pairs[pair] = e["pseq"] + 1
        else:
            e["gseq"] = groups.get(key, 0)
            groups[key] = e["gseq"] + 1
    return events


def _checked(path: Path, events: list[dict]) -> list[dict]:
    """``events`` as read from ``path``, each with its ``rank`` and ``op`` (else the file is not
    a ledger: :class:`RunFolderError` naming it)."""
    for n, e in enumerate(events, 1):
        if "op" not in e or "rank" not in e:
            raise RunFolderError(f"{str(path)!r} is not a paraloom ledger: event {n} has no "
                                 f"{'op' if 'op' not in e else 'rank'}")
    return events


def _rank_events(folder: Path, rank: int, path: Path) -> list[dict]:
    # a cut last line (a rank killed mid-write) is left out; any other bad line is an error
    events = {e.get("seq", i): e for i, e in enumerate(_checked(path, read_json_lines(path)))}
    for e in read_json_lines(rank_tail(folder, rank), strict=False):
        events[e.get("seq")] = e
    ordered = [events[k] for k in sorted(events, key=lambda k: (k is None, k or 0))]
    return settled(from_one(ordered, ledger=True))


def settled(events: list[dict]) -> list[dict]:
    """A blocking operation followed by any later one has completed, whatever a provisional
    line of a rank that died says (its ``pending`` mark was never rewritten)."""
    later = False
    for e in reversed(events):
        if later and e.get("pending") and not e.get("async"):
            e.pop("pending")
        later = later or e.get("op") != "compute"
    return events


def load(folder: str | Path) -> Evidence:
    """The evidence in ``folder``; :class:`RunFolderError` (naming the folder) if it holds
    no ledger."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RunFolderError(f"{str(folder)!r} is not a folder (give the folder of a paraloom "
                             f"record or train run)")
    files = rank_ledgers(folder)
    if not files and not (folder / LEDGER).is_file():
        raise RunFolderError(f"{str(folder)!r} holds no ledger ({LEDGER_DIR}/rank_R.jsonl or "
                             f"{LEDGER}): give the folder of a paraloom record or train run")
    ranks: dict[int, RankEvidence] = {}
    if files:
        for rank, path in files.items():
            ranks[rank] = RankEvidence(rank, _rank_events(folder, rank, path))
    else:
        for e in _checked(folder / LEDGER, read_ledger(folder / LEDGER)):
            ranks.setdefault(e["rank"], RankEvidence(e["rank"])).events.append(e)
    source = "record" if any((folder / LEDGER_DIR).glob("rank_*.status.json")) else "train"
    for rank, ev in ranks.items():
        ev.events = number([e for e in ev.events if e.get("op") != "compute"])
        ev.live = read_live(folder, rank)
        status = read_json(rank_status(folder, rank)) or {}
        if status:
            ev.exit, ev.error, ev.time = status.get("exit"), status.get("error"), \
                status.get("time")
    failure = read_json(folder / "failure.json") or {}
    for rank, info in (failure.get("ranks") or {}).items():
        ev = ranks.setdefault(int(rank), RankEvidence(int(rank)))
        ev.exit = info.get("exit", ev.exit)
        ev.error = info.get("error", ev.error)
        ev.time = info.get("time", ev.time)
        ev.stopped = bool(info.get("stopped"))
    if not any(ev.events or ev.exit is not None for ev in ranks.values()):
        raise RunFolderError(f"{str(folder)!r}: its ledgers hold no event and no rank's exit "
                             f"(nothing to diagnose)")
    world = max(ranks) + 1 if ranks else 0
    missing = [r for r in range(world) if r not in ranks]
    for r in missing:
        ranks[r] = RankEvidence(r)
    notes = [f"rank {r} left no ledger in {LEDGER_DIR}/" for r in missing]
    return Evidence(dict(sorted(ranks.items())), source, folder, notes=notes)
