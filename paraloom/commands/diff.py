"""``paraloom diff A B``: do two runs communicate identically, rank by rank?
(:mod:`paraloom.record.diff`; exit 0 equal, 1 different, 2 bad input.)"""

from __future__ import annotations

import argparse
import sys

from ..record.diff import (
    DEFAULT_FIELDS,
    NAME_FIELDS,
    DiffError,
    compare,
    fields_to_compare,
    report,
    sequences,
)
from ..run_folder import load_events

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom diff",
                                 description="Do two runs communicate identically, rank by rank?",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="see `python -m pydoc paraloom.record.diff` for how "
                                        "kinds are compared")
    ap.add_argument("a", metavar="A", help="run/record folder or ledger.jsonl")
    ap.add_argument("b", metavar="B", help="run/record folder or ledger.jsonl")
    ap.add_argument("--ignore-names", action="store_true",
                    help="do not compare site and module (different implementations)")
    ap.add_argument("--rank", type=int, help="compare only this rank")
    ap.add_argument("--fields", help=f"comma-separated fields to compare (default: "
                                     f"{','.join(DEFAULT_FIELDS + NAME_FIELDS)})")
    ap.add_argument("--kinds", choices=("dimension", "exact"), default="dimension",
                    help="dimension: sp counts as tp and unnamed groups match (default); "
                         "exact: the kind strings must be equal")
    ap.add_argument("--context", type=int, default=3, help="table rows around a divergence")
    args = ap.parse_args(argv)
    try:
        fields = fields_to_compare(args.fields, args.ignore_names)
        a, b = sequences(load_events(args.a)), sequences(load_events(args.b))
        if args.rank is not None:
            if args.rank not in a and args.rank not in b:
                raise DiffError(f"--rank {args.rank}: neither ledger has it (A has ranks "
                                f"{sorted(a)}, B has {sorted(b)})")
            a, b = {args.rank: a.get(args.rank, [])}, {args.rank: b.get(args.rank, [])}
        if not a and not b:
            raise DiffError(f"neither {args.a!r} nor {args.b!r} holds any communication event")
    except (DiffError, ValueError, OSError) as err:
        print(f"paraloom diff: error: {err}", file=sys.stderr)
        return 2
    result = compare(a, b, fields, kinds=args.kinds)
    print(f"A = {args.a}\nB = {args.b}\ncompared: {', '.join(fields)} (kinds: {args.kinds})")
    sys.stdout.write(report(a, b, result, fields, context=max(args.context, 0), kinds=args.kinds))
    equal = all(d is None for d in result.values())
    print("equal" if equal else "different")
    return 0 if equal else 1
