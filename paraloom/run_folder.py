"""The run folder (DESIGN.md, "Run folder"): its paths, and the one reader of its JSON files.

``paraloom train`` and ``paraloom record`` write the same folder::

    RUN/config.json          the run's settings (train) or the recorded program (record)
    RUN/metrics.jsonl        one line per optimizer step (train)
    RUN/ledger/rank_R.jsonl  each rank's events, appended as they happen (a crash keeps them)
    RUN/ledger/rank_R.status.json   how a recorded rank ended (record)
    RUN/ledger/rank_R.live.json     a running rank's heartbeat; rank_R.tail.jsonl its unflushed
                                    events once it is blocked (what ``diagnose`` reads)
    RUN/ledger.jsonl         every rank's events merged, ordered by (rank, seq)
    RUN/trace.json, comm_table.md, report.html, loss.png, summary.json, checkpoints/step_N/

Every JSON-lines file is read by :func:`read_json_lines`: a last line cut short (no newline at
its end: the writer was killed mid-line) is dropped silently, as it is what a crash leaves; any
other line that is not JSON is an error naming the file and the line (``strict``), or is skipped
(``strict=False``, for files a run rewrites as it goes). Every problem is a
:class:`RunFolderError` (a ``ValueError``) whose message names the file.

Steps are Megatron's iteration numbers, counted from 1, in every file and every command (the
ledger's ``setup`` events carry step 0: before the first iteration). Folders written before
that convention numbered the first iteration 0; :func:`read_ledger` and :func:`read_metrics`
renumber them as they read, so an old folder reads as a new one.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from .ledger import merge

__all__ = ["files_by_rank", "element_bytes", "RunFolderError", "CONFIG", "METRICS", "LEDGER",
           "LEDGER_DIR", "SUMMARY",
           "rank_ledger", "rank_status", "rank_live", "rank_tail", "rank_ledgers",
           "read_json_lines", "write_json_lines", "read_json", "load_events", "read_ledger",
           "read_metrics", "from_one",
           "write_events", "check_out", "written"]

CONFIG, METRICS, LEDGER, LEDGER_DIR, SUMMARY = ("config.json", "metrics.jsonl", "ledger.jsonl",
                                                "ledger", "summary.json")


class RunFolderError(ValueError):
    """A run folder or one of its files is missing or damaged; the message names the path."""


def rank_ledger(out: str | Path, rank: int) -> Path:
    """``out/ledger/rank_R.jsonl``: rank ``rank``'s own events."""
    return Path(out) / LEDGER_DIR / f"rank_{rank}.jsonl"


def rank_status(out: str | Path, rank: int) -> Path:
    """``out/ledger/rank_R.status.json``: how a recorded rank ended."""
    return Path(out) / LEDGER_DIR / f"rank_{rank}.status.json"


def rank_live(out: str | Path, rank: int) -> Path:
    """``out/ledger/rank_R.live.json``: a running rank's heartbeat (last activity, pending)."""
    return Path(out) / LEDGER_DIR / f"rank_{rank}.live.json"


def rank_tail(out: str | Path, rank: int) -> Path:
    """``out/ledger/rank_R.tail.jsonl``: the events a blocked rank had not flushed yet."""
    return Path(out) / LEDGER_DIR / f"rank_{rank}.tail.jsonl"


def rank_ledgers(out: str | Path) -> dict[int, Path]:
    """``{rank: path}`` of every per-rank ledger file in ``out/ledger``, by rank."""
    folder = Path(out) / LEDGER_DIR
    found = {}
    for path in folder.glob("rank_*.jsonl") if folder.is_dir() else ():
        tag = path.name[len("rank_"):-len(".jsonl")]
        if tag.isdigit():
            found[int(tag)] = path
    return dict(sorted(found.items()))


def read_json_lines(path: str | Path, *, strict: bool = True,
                    notes: list[str] | None = None) -> list[dict]:
    """The JSON objects of a JSON-lines file (``[]`` when it does not exist).

    The last line is dropped if it does not parse and has no newline (a writer stopped
    mid-line); another line that does not parse raises :class:`RunFolderError` naming the file
    and its line number, unless ``strict=False`` (then it is skipped). A line holding JSON that
    is not an object is an error either way: the file is not what it is named. A dropped cut
    line is said in ``notes`` when given, else on stderr."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise RunFolderError(f"{str(path)!r} is not a file")
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RunFolderError(f"{str(path)!r} cannot be read: {err}") from None
    lines = text.splitlines()
    cut = len(lines) if text and not text.endswith("\n") else None  # a line cut short
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            if number == cut:
                note = (f"{str(path)!r}: its last line was cut off (a writer stopped "
                        f"mid-line) and is left out")
                if notes is None:
                    print(f"paraloom: note: {note}", file=sys.stderr)
                else:
                    notes.append(note)
            if number == cut or not strict:
                continue
            raise RunFolderError(f"{str(path)!r} is not a JSON Lines file: line {number} is not "
                                 f"JSON ({err.msg})") from None
        if not isinstance(value, dict):
            raise RunFolderError(f"{str(path)!r} line {number} holds {type(value).__name__}, "
                                 f"not a JSON object")
        out.append(value)
    return out


def write_json_lines(path: str | Path, rows: Iterable[dict], mode: str = "w") -> None:
    """Write (``mode="a"``: append) one JSON object per line."""
    with open(path, mode) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_json(path: str | Path, what: str = "a JSON object") -> dict | None:
    """The JSON object in ``path`` (``None`` when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunFolderError(f"{str(path)!r} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise RunFolderError(f"{str(path)!r} holds {type(value).__name__}, not {what}")
    return value


def _check_events(path: Path, events: list[dict]) -> list[dict]:
    for i, e in enumerate(events):
        if "rank" not in e or "op" not in e:
            raise RunFolderError(f"{str(path)!r}: event {i + 1} is not a ledger event (needs at "
                                 f"least 'rank' and 'op')")
    return events


def from_one(rows: list[dict], *, ledger: bool) -> list[dict]:
    """``rows`` (ledger events, or metrics lines with ``ledger=False``) with steps counted from 1:
    unchanged unless they come from a folder that counted from 0 (a metrics line of step 0, or an
    event of step 0 outside ``setup``), whose steps are then moved up by one (the ``setup``
    events keep step 0)."""
    old = any(r.get("step") == 0 and (not ledger or r.get("phase") != "setup") for r in rows)
    if not old:
        return rows
    return [{**r, "step": r["step"] + 1} if isinstance(r.get("step"), int)
            and (not ledger or r.get("phase") != "setup") else r for r in rows]


def read_ledger(path: str | Path, *, strict: bool = True,
                notes: list[str] | None = None) -> list[dict]:
    """The events of one ledger file (:func:`read_json_lines`), steps counted from 1."""
    return from_one(read_json_lines(path, strict=strict, notes=notes), ledger=True)


def read_metrics(path: str | Path, *, strict: bool = True) -> list[dict]:
    """The lines of a ``metrics.jsonl`` (:func:`read_json_lines`), steps counted from 1."""
    return from_one(read_json_lines(path, strict=strict), ledger=False)


def load_events(path: str | Path, notes: list[str] | None = None) -> list[dict]:
    """Every rank's events of a run or record folder (its ``ledger.jsonl``, else the per-rank
    files a run left while it ran) or of a ledger file, ordered by ``(rank, seq)``; a file's
    last line cut off mid-write is left out and said in ``notes`` when given."""
    p = Path(path)
    if p.is_dir():
        if (p / LEDGER).is_file():
            p = p / LEDGER
        else:
            files = rank_ledgers(p)
            if not files:
                raise RunFolderError(f"{str(path)!r} is a folder without {LEDGER} or "
                                     f"{LEDGER_DIR}/rank_*.jsonl (give a run or record folder, "
                                     f"or a ledger file)")
            return merge(_check_events(f, read_ledger(f, notes=notes))
                         for f in files.values())
    elif not p.is_file():
        raise RunFolderError(f"{str(path)!r} does not exist (give a run or record folder, or a "
                             f"ledger file)")
    return merge([_check_events(p, read_ledger(p, notes=notes))])


def write_events(out: str | Path, events: list[dict]) -> Path:
    """``out/ledger.jsonl``: the merged events of every rank."""
    path = Path(out) / LEDGER
    write_json_lines(path, events)
    return path


def written(out: str | Path, names: Iterable[str]) -> str:
    """``"a, b, c/"``: those of ``names`` that exist in ``out`` (a trailing ``/``: a folder that
    holds something), so a command lists what it wrote, not what it meant to."""
    out, found = Path(out), []
    for name in names:
        path = out / name.rstrip("/")
        if (path.is_dir() and any(path.iterdir())) if name.endswith("/") else path.is_file():
            found.append(name)
    return ", ".join(found) or "nothing"


def check_out(out: str | Path, flag: str = "--out", *, create: bool = False) -> None:
    """``ValueError`` unless ``out`` is (or can become) a run folder this process can write.
    ``create=False`` creates nothing (a refused run leaves no folder); ``create=True`` makes
    ``out/ledger`` as every rank would."""
    path = Path(out).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(out)!r} exists and is not a folder (it is an existing "
                         f"file); give a run folder")
    if create:
        try:
            (path / LEDGER_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"{flag} {str(out)!r} cannot be created ({err.strerror or err}): "
                             f"give a writable folder path") from None
    existing = next(p for p in (path / LEDGER_DIR, path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {str(out)!r} cannot be created: {str(existing)!r} is not a "
                         f"folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(out)!r} cannot be written: {str(existing)!r} is not "
                         f"writable")


def files_by_rank(folder: Path, pattern: re.Pattern) -> dict[int, Path]:
    """The files of ``folder`` whose name ``pattern`` finds a rank in (its first group), by
    rank: one file per rank, as a job's dumps or traces come."""
    found = {}
    for path in sorted(folder.iterdir()):
        m = pattern.search(path.name)
        if path.is_file() and m:
            found[int(m.group(1))] = path
    return found


def element_bytes(dtype: str | None) -> int:
    """Bytes of one element of a dtype named as in a ledger (``"bfloat16"``), 0 if unknown."""
    import torch
    kind = getattr(torch, dtype, None) if dtype else None
    return kind.itemsize if isinstance(kind, torch.dtype) else 0
