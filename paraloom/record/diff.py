"""``paraloom diff A B``: do two runs communicate identically, rank by rank?

    paraloom diff RUN_A RUN_B [--step 2 | 1-3 | setup,1] [--ignore-names] [--rank R]
                  [--fields phase,op,bytes] [--kinds exact] [--phases exact]
                  [--shapes numel] [--one-rank-groups] [--context N]

A and B are run or record folders (``ledger.jsonl``, or a recorder's partial
``ledger/rank_R.jsonl``) or ledger files (:func:`paraloom.run_folder.load_events`). Each rank's
*communication sequence* is its events of the chosen steps in launch order (``seq``), without the
compute spans, without ``setup`` (unless ``--step`` names it) and without collectives on
one-rank groups (Megatron issues its dp all-reduce at dp = 1 and its cross-entropy all-reduces
at tp = 1 as no-ops; paraloom issues nothing; ``--one-rank-groups`` keeps them). Two events are
equal when they agree on the compared fields: phase, kind, op, async, dtype, bytes, shape, peer,
group (the global ranks of the process group) — and site and module unless ``--ignore-names``
(two implementations never share file names). The two sequences are aligned by their longest
common subsequence (``difflib``'s matcher, junk heuristics off), so every divergence is listed
where it is — changed events side by side, events only in A or only in B on their own — with the
counts of equal, changed, only-in-A and only-in-B events per rank. Exit codes: 0 equal (every
rank, the same ranks on both sides), 1 different, 2 bad input (the message names the value).

How fields are compared:

* ``kind`` (``--kinds dimension``, the default) compares the parallel *dimension*: ``sp`` counts
  as ``tp`` (sequence parallelism runs on the tensor-parallel group: paraloom's layers say
  ``sp``, a recorded Megatron-Core run, whose ``parallel_state`` has no sequence-parallel group,
  says ``tp``). An event on a group of global ranks that some known kind names (in either
  run; the first name seen) takes that name, so a recorder's unnamed ``group[0,1]`` and two
  names of one rank set (paraloom's dispatcher says ``ep`` on its ``tp_ep`` group, where the
  recorder says ``tp_ep``; a layout where tp x ep is every rank) agree; other groups keep
  their kind. The ranks are compared in ``group`` anyway. ``--kinds exact``: the kind strings
  must be equal.
* ``phase`` (``--phases loose``, the default): ``other`` — a recorded program's code outside
  every forward, autograd and optimizer region, such as Megatron-LM's ``train_step`` after
  ``optimizer.step()`` — equals ``optimizer``, paraloom's phase for the same calls, and so does
  paraloom's ``data`` (the batch broadcast of ``--megatron-lm-loop``; ``other`` in a record).
  ``--phases exact``: the strings must be equal. Either way an event paraloom marks
  ``recompute`` (a forward communication re-run by activation recomputation) counts as
  ``backward``, where it runs and where the recorder sees a program's re-runs.
* ``shape`` (``--shapes exact``, the default) compares dimensions; ``--shapes numel`` only the
  element count (``[b, s, h]`` equals ``[s, b, h]``).
"""

from __future__ import annotations

import difflib
import math

__all__ = ["DEFAULT_FIELDS", "NAME_FIELDS", "DIMENSIONS", "VALID_FIELDS", "DiffError",
           "Options", "parse_steps", "sequences", "compare", "equal", "fields_to_compare",
           "named_groups", "field_value"]

DEFAULT_FIELDS = ("phase", "kind", "op", "async", "dtype", "bytes", "shape", "peer", "group")
"""Fields every aligned pair must agree on (``--fields`` replaces them)."""
NAME_FIELDS = ("site", "module")
"""Where the call came from; compared unless ``--ignore-names``."""
DIMENSIONS = {"tp": "tp", "sp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep",
              "emb": "emb", "loss": "loss", "mp": "mp", "distopt": "distopt", "world": "world",
              "etp": "etp", "edp": "edp", "tp_ep": "tp_ep", "tp_ep_pp": "tp_ep_pp"}
"""Known kinds and the parallel dimension (process group) each one runs on."""
VALID_FIELDS = ("rank", "step", "microbatch", "phase", "kind", "op", "site", "module", "split",
                "async", "bytes", "shape", "dtype", "group", "peer")
_OUTSIDE = {"other": "optimizer", "data": "optimizer"}  # --phases loose


class DiffError(ValueError):
    """Bad input to ``paraloom diff`` (exit code 2)."""


class Options:
    """How events are chosen and compared (the command's flags)."""

    def __init__(self, *, fields=DEFAULT_FIELDS, steps: set | None = None,
                 kinds: str = "dimension", phases: str = "loose", shapes: str = "exact",
                 one_rank_groups: bool = False) -> None:
        for name, value, valid in (("kinds", kinds, ("dimension", "exact")),
                                   ("phases", phases, ("loose", "exact")),
                                   ("shapes", shapes, ("exact", "numel"))):
            if value not in valid:
                raise DiffError(f"--{name} {value!r}: valid values are {', '.join(valid)}")
        self.fields = tuple(fields)
        self.steps = steps
        self.kinds, self.phases, self.shapes = kinds, phases, shapes
        self.one_rank_groups = one_rank_groups


def parse_steps(text: str | None) -> set | None:
    """``--step``: ``2``, ``1-3``, ``setup``, or a comma list of those (steps count from 1, as
    Megatron's iterations); ``None`` (all steps but setup) when not given. The result holds
    step numbers and possibly ``"setup"``."""
    if text is None:
        return None
    chosen: set = set()
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        try:
            if part == "setup":
                chosen.add("setup")
            elif dash:
                a, b = int(lo), int(hi)
                if a < 1 or b < a:
                    raise ValueError
                chosen.update(range(a, b + 1))
            else:
                if int(part) < 1:
                    raise ValueError
                chosen.add(int(part))
        except ValueError:
            raise DiffError(f"--step {text!r}: give a step (2; steps count from 1), a range "
                            f"(1-3), 'setup', or a comma list of them; {part!r} is none of "
                            f"these") from None
    return chosen


def _chosen(event: dict, options: Options) -> bool:
    if event["op"] == "compute":
        return False
    group = event.get("group")
    if not options.one_rank_groups and isinstance(group, list) and len(group) == 1:
        return False
    setup = event.get("phase") == "setup"
    if options.steps is None:
        return not setup
    if setup:
        return "setup" in options.steps
    return event.get("step") in options.steps  # an event without a step is in none


def sequences(events: list[dict], options: Options | None = None) -> dict[int, list[dict]]:
    """Each rank's chosen communication events, in launch order."""
    options = options or Options()
    out: dict[int, list[dict]] = {}
    for e in events:
        if _chosen(e, options):
            out.setdefault(e["rank"], []).append(e)
    for seq in out.values():
        seq.sort(key=lambda e: e.get("seq", 0))
    return dict(sorted(out.items()))


def named_groups(*runs: dict[int, list[dict]]) -> dict[tuple, str]:
    """Global rank sets of the groups a known kind names, in either run."""
    named: dict[tuple, str] = {}
    for run in runs:
        for seq in run.values():
            for e in seq:
                dim = DIMENSIONS.get(e.get("kind"))
                if dim is not None and isinstance(e.get("group"), list):
                    named.setdefault(tuple(e["group"]), dim)
    return named


def field_value(field: str, event: dict, options: Options, named: dict):
    value = event.get(field)
    if field == "kind" and options.kinds == "dimension" and value is not None:
        group = tuple(event["group"]) if isinstance(event.get("group"), list) else None
        dim = named.get(group) if group is not None else None  # the ranks decide
        return dim or DIMENSIONS.get(value) or value
    if field == "phase" and event.get("recompute"):
        value = "backward"  # paraloom marks a re-run's forward; it runs inside backward
    if field == "phase" and options.phases == "loose":
        return _OUTSIDE.get(value, value)
    if field == "shape" and options.shapes == "numel" and isinstance(value, list):
        return math.prod(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def _keys(seq: list[dict], options: Options, named: dict) -> list[tuple]:
    return [tuple(field_value(f, e, options, named) for f in options.fields) for e in seq]


def compare(a: dict[int, list[dict]], b: dict[int, list[dict]],
            options: Options | None = None) -> dict[int, dict]:
    """Per rank: ``{"equal", "changed", "only_a", "only_b"}`` counts and ``hunks``, the
    non-equal stretches of the alignment as ``(tag, a_from, a_to, b_from, b_to)`` with
    ``tag`` one of ``replace`` (changed), ``delete`` (only in A), ``insert`` (only in B)."""
    options = options or Options()
    named = named_groups(a, b)
    out: dict[int, dict] = {}
    for rank in sorted(set(a) | set(b)):
        ka = _keys(a.get(rank, []), options, named)
        kb = _keys(b.get(rank, []), options, named)
        counts = {"equal": 0, "changed": 0, "only_a": 0, "only_b": 0, "hunks": []}
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ka, kb,
                                                           autojunk=False).get_opcodes():
            if tag == "equal":
                counts["equal"] += i2 - i1
                continue
            counts["hunks"].append((tag, i1, i2, j1, j2))
            paired = min(i2 - i1, j2 - j1) if tag == "replace" else 0
            counts["changed"] += paired
            counts["only_a"] += (i2 - i1) - paired
            counts["only_b"] += (j2 - j1) - paired
        out[rank] = counts
    return out


def equal(result: dict[int, dict]) -> bool:
    """Whether every rank's sequences are equal."""
    return all(not r["hunks"] for r in result.values())


def fields_to_compare(text: str | None, ignore_names: bool) -> tuple[str, ...]:
    """The fields ``--fields`` names (default: :data:`DEFAULT_FIELDS`, and the names unless
    ``ignore_names``); :class:`DiffError` for an unknown one."""
    if text is None:
        return DEFAULT_FIELDS + (() if ignore_names else NAME_FIELDS)
    fields = tuple(f.strip() for f in text.replace(" ", ",").split(",") if f.strip())
    bad = [f for f in fields if f not in VALID_FIELDS]
    if bad or not fields:
        raise DiffError(f"--fields {text!r}: unknown field(s) {bad or '(none given)'}; valid: "
                        f"{', '.join(VALID_FIELDS)}")
    if ignore_names:
        fields = tuple(f for f in fields if f not in NAME_FIELDS)
        if not fields:
            raise DiffError(f"--fields {text!r} with --ignore-names leaves no field to compare "
                            f"(--ignore-names drops {', '.join(NAME_FIELDS)}); name another "
                            f"field, e.g. --fields op,shape")
    return fields
