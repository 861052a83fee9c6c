"""``paraloom diff A B``: do two runs communicate identically, rank by rank?
(:mod:`paraloom.record.diff`; exit 0 equal, 1 different, 2 bad input.)"""

from __future__ import annotations

import argparse
import sys

from ..record.diff import (
    DEFAULT_FIELDS,
    NAME_FIELDS,
    DiffError,
    Options,
    compare,
    equal,
    fields_to_compare,
    parse_steps,
    sequences,
)
from ..record.diff_report import report
from ..report.table import steps_of
from ..run_folder import load_events

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom diff",
                                 description="Do two runs communicate identically, rank by rank?",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="see `python -m pydoc paraloom.record.diff` for how "
                                        "events are chosen, aligned and compared")
    ap.add_argument("a", metavar="A", help="run/record folder or ledger.jsonl")
    ap.add_argument("b", metavar="B", help="run/record folder or ledger.jsonl")
    ap.add_argument("--step", metavar="STEPS",
                    help="steps to compare (counted from 1): 2, 1-3, setup, or a comma list "
                         "(default: every step, setup excluded)")
    ap.add_argument("--ignore-names", action="store_true",
                    help="do not compare site and module (different implementations)")
    ap.add_argument("--rank", type=int, help="compare only this rank")
    ap.add_argument("--fields", help=f"comma-separated fields to compare (default: "
                                     f"{','.join(DEFAULT_FIELDS + NAME_FIELDS)})")
    ap.add_argument("--kinds", choices=("dimension", "exact"), default="dimension",
                    help="dimension: sp counts as tp, unnamed groups take the kind of a named "
                         "group with the same ranks (default); exact: equal strings")
    ap.add_argument("--phases", choices=("loose", "exact"), default="loose",
                    help="loose: a recorded program's 'other' and paraloom's 'data' equal "
                         "'optimizer' (default)")
    ap.add_argument("--shapes", choices=("exact", "numel"), default="exact",
                    help="numel: compare shapes by their element count")
    ap.add_argument("--one-rank-groups", action="store_true",
                    help="keep collectives on one-rank groups (no-ops; left out by default)")
    ap.add_argument("--context", type=int, default=1,
                    help="equal rows shown before each divergence (default 1)")
    args = ap.parse_args(argv)
    try:
        if args.context < 0:
            raise DiffError(f"--context {args.context}: give the number of equal events shown "
                            f"around each difference, 0 or more")
        options = Options(fields=fields_to_compare(args.fields, args.ignore_names),
                          steps=parse_steps(args.step), kinds=args.kinds, phases=args.phases,
                          shapes=args.shapes, one_rank_groups=args.one_rank_groups)
        notes: list[str] = []
        events_a, events_b = load_events(args.a, notes), load_events(args.b, notes)
        a, b = sequences(events_a, options), sequences(events_b, options)
        notes += _lacking(args, options, events_a, events_b, bool(a), bool(b))
        notes += _ranks_differ(events_a, events_b)
        if args.rank is not None:
            if args.rank not in a and args.rank not in b:
                raise DiffError(f"--rank {args.rank}: neither ledger has it in the chosen "
                                f"steps (A has ranks {sorted(a)}, B has {sorted(b)})")
            a, b = {args.rank: a.get(args.rank, [])}, {args.rank: b.get(args.rank, [])}
        if not a and not b:
            raise DiffError(_nothing(args, events_a, events_b))
    except (DiffError, ValueError, OSError) as err:
        print(f"paraloom diff: error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    result = compare(a, b, options)
    step = f"steps {args.step}" if args.step else "every step (setup excluded)"
    print(f"A = {args.a}\nB = {args.b}\ncompared: {', '.join(options.fields)} in {step} "
          f"(kinds: {args.kinds}, phases: {args.phases}, shapes: {args.shapes})")
    sys.stdout.write(report(a, b, result, options, context=args.context))
    same = equal(result)
    print("equal" if same else "different")
    return 0 if same else 1


def _ranks_differ(events_a: list[dict], events_b: list[dict]) -> list[str]:
    """A note when the two runs did not have the same ranks (other world sizes)."""
    ranks_a, ranks_b = ({e["rank"] for e in ev} for ev in (events_a, events_b))
    if ranks_a == ranks_b or not ranks_a or not ranks_b:
        return []
    sides = [f"rank{'s' if len(r) > 1 else ''} {_span(sorted(r))} only in {side}"
             for side, r in (("A", ranks_a - ranks_b), ("B", ranks_b - ranks_a)) if r]
    return [f"A has {len(ranks_a)} ranks, B has {len(ranks_b)}: {'; '.join(sides)} (the runs "
            f"have different worlds; those ranks are compared against nothing)"]


def _span(ranks: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``2-4, 7``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{x[0]}-{x[-1]}" if len(x) > 1 else str(x[0]) for x in runs)


def _label(steps: list) -> str:
    return ", ".join(map(str, steps)) or "none"


def _lacking(args, options, events_a, events_b, has_a: bool, has_b: bool) -> list[str]:
    """Notes for chosen steps one side lacks; :class:`DiffError` when one side has none of
    them (or no communication at all) while the other has some: nothing to compare."""
    notes = []
    for name, path, events, has, other in (("A", args.a, events_a, has_a, has_b),
                                           ("B", args.b, events_b, has_b, has_a)):
        steps = steps_of(events)
        if options.steps is None:
            if not has and other:
                raise DiffError(f"{name} ({path!r}) holds no communication event outside "
                                f"setup (its steps: {_label(steps)})")
            continue
        missing = sorted(options.steps - set(steps), key=lambda s: (s != "setup", str(s)))
        if missing and not has and other:
            raise DiffError(f"--step {args.step}: {name} ({path!r}) has no "
                            f"{'step ' if missing[0] != 'setup' else ''}"
                            f"{', '.join(map(str, missing))} (its steps: {_label(steps)}); "
                            f"nothing to compare the other side's with")
        if missing and has:
            notes.append(f"{name} has no {', '.join(map(str, missing))} of --step {args.step} "
                         f"(its steps: {_label(steps)})")
    return notes


def _nothing(args, events_a: list[dict], events_b: list[dict]) -> str:
    """Why nothing was chosen: the steps each side has."""
    if args.step is None:
        return f"neither {args.a!r} nor {args.b!r} holds any communication event"
    a, b = _label(steps_of(events_a)), _label(steps_of(events_b))
    return f"--step {args.step}: no communication in either run (A has steps {a}; B has {b})"
