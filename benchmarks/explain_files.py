"""``paraloom explain`` over every Python file of a tree: crashes, sites and time per file.

    .venv/bin/python benchmarks/explain_files.py [ROOT ...] [--json OUT] [--set NAME=VALUE ...]

ROOT defaults to the installed megatron/core and the test fixtures (picotron, torchtitan,
nanotron). A file that raises is a crash (its traceback's last line is printed); the time is
the reader's own (parse, follow calls, answers), one process, files read in sorted order, so
two runs on the same machine compare. Used to check that a change to the reader neither
crashes on real code nor slows it down (a ratio against the previous commit's figures).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

from paraloom.explain import explain
from paraloom.explain.conditions import parse_settings


def _default_roots() -> list[Path]:
    import importlib.util
    roots = [Path(__file__).parent.parent / "tests" / "fixtures"]
    spec = importlib.util.find_spec("megatron")
    if spec is not None and spec.submodule_search_locations:
        roots.insert(0, Path(list(spec.submodule_search_locations)[0]) / "core")
    return roots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("roots", nargs="*", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args()
    settings = parse_settings(args.set)
    files = sorted(f for r in (args.roots or _default_roots()) for f in r.rglob("*.py"))
    crashes, rows, start = [], [], time.perf_counter()
    for f in files:
        t = time.perf_counter()
        try:
            facts = explain(str(f), settings=settings)
        except Exception:  # noqa: BLE001 - a crash is what this counts
            crashes.append((str(f), traceback.format_exc().strip().splitlines()[-1]))
            continue
        rows.append({"file": str(f), "seconds": time.perf_counter() - t,
                     "sites": len(facts["sites"])})
    total = time.perf_counter() - start
    print(f"{len(files)} files, {len(crashes)} crashes, {sum(r['sites'] for r in rows)} sites, "
          f"{total:.1f} s ({1000 * total / max(len(files), 1):.1f} ms a file)")
    for f, why in crashes:
        print(f"  crash: {f}: {why}")
    slow = sorted(rows, key=lambda r: -r["seconds"])[:5]
    print("slowest: " + ", ".join(f"{Path(r['file']).name} {r['seconds']:.2f} s" for r in slow))
    if args.json:
        args.json.write_text(json.dumps({"files": rows, "crashes": crashes, "total_s": total},
                                        indent=1))


if __name__ == "__main__":
    main()
