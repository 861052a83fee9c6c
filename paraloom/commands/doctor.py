"""``paraloom doctor``: why the provider in config.toml does not answer, and the fix.

    paraloom doctor [--config PATH] [--json] [--timeout SECONDS]

Prints one line per check (config, key, base_url, model, wire_api; see :mod:`paraloom.llm.doctor`)
with the fix for each problem; the key is never printed. Exit codes: 0 every check passed,
1 a problem was found, 2 bad input.
"""

from __future__ import annotations

import argparse
import json

from ..llm import diagnose

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="paraloom doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="Codex-style config.toml (default ~/.codex/config.toml)")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    ap.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS",
                    help="deadline of each request, whole answer included (default 15)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not 0 < args.timeout < 3600:
        ap.error(f"--timeout {args.timeout:g}: expected seconds in (0, 3600)")
    found = diagnose(args.config, timeout=args.timeout)
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for f in found:
            if f["ok"]:
                print(f"ok       {f['check']}: {f['detail']}")
            else:
                print(f"PROBLEM  {f['check']}: {f['problem']}\n         fix: {f['fix']}")
    return 0 if all(f["ok"] for f in found) else 1
