"""One rank of ``paraloom record``: install the recorder, then run the user's program unchanged.

The recorder is installed before the program imports anything, so import-time aliases
(``dist_all_gather_func = torch.distributed.all_gather_into_tensor``), DDP, FSDP2, DTensor and
pipelining all run with it in place. The program runs as ``__main__`` (``runpy``) with its own
``sys.argv``; its exit code is this process's. Next to the rank's ledger it leaves
``rank_R.status.json``: the exit code, the error line if it raised, whether it ever created a
process group, whether it started processes of its own, and the collectives it called inside
``torch.inference_mode`` (which the recorder cannot see) — what the launcher reports.

    python -m paraloom.record.bootstrap OUT STEPS COMPUTE (-m MODULE | SCRIPT) [ARGS...]
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import runpy
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..run_folder import rank_status
from . import megatron_core_cpu, megatron_lm_cpu
from .recorder import record_comms

MEGATRON_ON_CPU = "PARALOOM_MEGATRON_ON_CPU"
"""Set to ``1`` by ``record --megatron-on-cpu`` for its local ranks."""
HANG_AFTER = "PARALOOM_HANG_AFTER"
"""``record --hang-after S`` for its ranks: they beat so that the watcher can tell they hang."""

__all__ = ["run_program"]

_KEEP: list = []
"""What the program leaves behind, held until the rank ends with ``os._exit``: the globals
``runpy`` returns, or the exception it ended with (its traceback's frames hold the program's
globals). Freeing them when the program returns runs its objects' destructors while gloo's
threads still work: ``~Reducer`` (a module-level DDP) joins a gloo thread while holding the GIL,
and that thread, finishing an ``AsyncAllreduceWork``, waits for the GIL to drop a Python
reference — a deadlock seen in 2-3 of 12 runs of a DDP program. Never freed, they cannot."""


def _watch(seen: dict) -> None:
    """Note whether the program creates a process group, and whether it starts processes of its
    own (patched before it imports).

    ``init_process_group`` is wrapped for programs that call it, but a module may hold its own
    reference, taken at import (``device_mesh`` imports it by name, so ``init_device_mesh``
    never calls the patched attribute); c10d's ``_update_default_pg``, which c10d looks up as a
    global on every call, sees the default group being set either way. The caller also counts
    ``dist.is_initialized()`` and any recorded communication. Started processes
    (``multiprocessing``, hence ``torch.multiprocessing.spawn``) are not recorded: the launcher
    says so when they are why nothing was."""

    init = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        seen["init"] = True
        return init(*args, **kwargs)

    dist.init_process_group = c10d.init_process_group = init_process_group
    update = getattr(c10d, "_update_default_pg", None)
    if update is not None:
        def _update_default_pg(pg):
            seen["init"] = seen["init"] or pg is not None
            return update(pg)
        c10d._update_default_pg = _update_default_pg
    start = multiprocessing.process.BaseProcess.start

    def start_process(self):
        seen["children"] = True
        return start(self)

    multiprocessing.process.BaseProcess.start = start_process
    _watch_inference_mode(seen)


UNSEEN = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
          "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single",
          "send", "recv", "barrier", "gather", "scatter", "batch_isend_irecv",
          "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
"""``torch.distributed`` functions whose calls inside ``torch.inference_mode`` are counted: the
recorder's dispatcher kernels sit on the autograd keys, which inference mode skips. Not
``isend``/``irecv``: ``P2POp`` checks their identity (their ops go through
``batch_isend_irecv``, counted)."""


def _watch_inference_mode(seen: dict) -> None:
    """Count the program's ``torch.distributed`` calls made while inference mode is on (the
    recorder cannot see them), with the first call's site, into ``seen["unrecorded"]``. Calls
    through a reference taken before the program ran, or issued from another tensor subclass's
    ``__torch_dispatch__``, are not counted either: the status says what is not covered."""
    counts = seen.setdefault("unrecorded", {})

    def wrap(name, fn):
        def watched(*args, **kwargs):
            if torch.is_inference_mode_enabled():
                caller = sys._getframe(1)
                where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
                counts.setdefault(name, {"count": 0, "site": where})["count"] += 1
            return fn(*args, **kwargs)
        watched.__wrapped__ = fn
        return watched
    for name in UNSEEN:
        fn = getattr(c10d, name, None)
        if fn is not None:
            setattr(dist, name, wrap(name, fn))


def run_program(out: str, steps: int | None, compute: bool, target: list[str],
                t0: float | None = None, megatron_on_cpu: bool = False,
                hang_after: float = 0.0) -> int:
    """Run ``target`` (``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]``) under
    ``record_comms``; returns the program's exit code (1 if it raised)."""
    rank = int(os.environ.get("RANK", "0"))
    status = rank_status(out, rank)
    status.parent.mkdir(parents=True, exist_ok=True)
    status.unlink(missing_ok=True)  # an older record's: rank 0 of a joined world must not read it
    seen = {"init": False, "children": False}
    _watch(seen)
    if megatron_on_cpu:
        megatron_core_cpu.install()
        megatron_lm_cpu.install()
    code, error = 0, None
    with record_comms(out=out, steps=steps, compute=compute, rank=rank, t0=t0,
                      heartbeat=hang_after) as ledger:
        try:
            if target[0] == "-m":
                sys.argv = [target[1], *target[2:]]
                if os.getcwd() not in sys.path and "" not in sys.path:
                    sys.path.insert(0, os.getcwd())  # as python -m: the working directory first
                _KEEP.append(runpy.run_module(target[1], run_name="__main__", alter_sys=True))
            else:
                sys.argv = list(target)
                sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
                _KEEP.append(runpy.run_path(target[0], run_name="__main__"))
        except SystemExit as stop:
            _KEEP.append(stop)
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                error = str(stop.code)
        except BaseException as err:  # noqa: BLE001 - the program's failure, reported
            _KEEP.append(err)
            traceback.print_exc()
            sys.stderr.flush()
            code, error = 1, f"{type(err).__name__}: {err}".splitlines()[0]
        init = seen["init"] or dist.is_initialized() \
            or any(e["op"] != "compute" for e in ledger.events)
    status.write_text(json.dumps({
        "rank": rank, "exit": code, "error": error, "init": init, "children": seen["children"],
        "time": time.time(), "unrecorded": seen.get("unrecorded", {}),
        "not_covered": "collectives inside torch.inference_mode (counted in unrecorded when "
                       "called as torch.distributed.NAME) and those issued from another tensor "
                       "subclass's __torch_dispatch__ skip the autograd dispatch keys the "
                       "recorder listens on: they are not in the ledger"}))
    return code


def main(argv: list[str]) -> int:
    out, steps, compute, *target = argv
    t0 = os.environ.get("PARALOOM_RECORD_T0")
    return run_program(out, int(steps) if steps != "0" else None, compute == "1", target,
                       float(t0) if t0 else None,
                       megatron_on_cpu=os.environ.get(MEGATRON_ON_CPU) == "1",
                       hang_after=float(os.environ.get(HANG_AFTER) or 0))


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no lingering non-daemon threads of the program keep the rank alive
