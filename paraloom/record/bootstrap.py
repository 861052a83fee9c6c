"""One rank of ``paraloom record``: install the recorder, then run the user's program unchanged.

The recorder is installed before the program imports anything, so import-time aliases
(``dist_all_gather_func = torch.distributed.all_gather_into_tensor``), DDP, FSDP2, DTensor and
pipelining all run with it in place. The program runs as ``__main__`` (``runpy``) with its own
``sys.argv``; its exit code is this process's. Next to the rank's ledger it leaves
``rank{R}.status.json``: the exit code, the error line if it raised, and whether it ever called
``init_process_group`` — what the launcher reports.

    python -m paraloom.record.bootstrap OUT STEPS COMPUTE (-m MODULE | SCRIPT) [ARGS...]
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

__all__ = ["run_program"]


def _watch_init() -> dict:
    """Note whether the program initialises a process group (patched before it imports)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    seen = {"init": False}
    orig = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        seen["init"] = True
        return orig(*args, **kwargs)

    dist.init_process_group = c10d.init_process_group = init_process_group
    return seen


def run_program(out: str, steps: int | None, compute: bool, target: list[str],
                t0: float | None = None) -> int:
    """Run ``target`` (``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]``) under
    ``record_comms``; returns the program's exit code (1 if it raised)."""
    from .recorder import record_comms

    rank = int(os.environ.get("RANK", "0"))
    status = Path(out) / "ledger" / f"rank{rank}.status.json"
    status.parent.mkdir(parents=True, exist_ok=True)
    seen = _watch_init()
    code, error = 0, None
    with record_comms(out=out, steps=steps, compute=compute, rank=rank, t0=t0):
        try:
            if target[0] == "-m":
                sys.argv = [target[1], *target[2:]]
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(target)
                sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
                runpy.run_path(target[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                error = str(stop.code)
        except BaseException as err:  # noqa: BLE001 - the program's failure, reported
            traceback.print_exc()
            sys.stderr.flush()
            code, error = 1, f"{type(err).__name__}: {err}".splitlines()[0]
    status.write_text(json.dumps({"rank": rank, "exit": code, "error": error,
                                  "init": seen["init"], "time": time.time()}))
    return code


def main(argv: list[str]) -> int:
    out, steps, compute, *target = argv
    t0 = os.environ.get("PARALOOM_RECORD_T0")
    return run_program(out, int(steps) if steps != "0" else None, compute == "1", target,
                       float(t0) if t0 else None)


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no lingering non-daemon threads of the program keep the rank alive
