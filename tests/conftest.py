"""Multi-rank test harness: one warm gloo world per test module, reused by every test in it.

Ranks are forked from the pytest process (torch already imported: ~0.1 s instead of ~2.5 s per
rank) and stay alive; ``world.run(fn, *args)`` runs the module-level function ``fn(*args)`` on
every rank and returns the per-rank results. A rank that raises fails the test with its rank and
traceback; a rank that does not answer in time is killed with the whole world, which is restarted
for the next test. Functions must be module-level (they are pickled by reference).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback

import pytest
import torch

RUN_TIMEOUT_S = float(os.environ.get("PARALOOM_TEST_TIMEOUT", "240"))


def _worker(rank: int, size: int, store: str, conn) -> None:
    torch.set_num_threads(1)  # see paraloom.launch.spawn: OpenMP does not survive fork
    from paraloom import launch

    launch.init_distributed(rank, size, init_method=f"file://{store}", backend="gloo",
                            timeout_s=60)
    while True:
        job = conn.recv()
        if job is None:
            break
        fn, args = job
        try:
            payload = ("ok", fn(*args))
        except BaseException:  # noqa: BLE001 - reported to the parent with the rank
            payload = ("error", traceback.format_exc())
        try:
            conn.send_bytes(pickle.dumps(payload))
        except Exception:  # unpicklable result
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    launch.shutdown()


class World:
    """``size`` forked gloo ranks that run test functions on request."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list = []
        self.conns: list = []
        self.store: str | None = None

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        fd, store = tempfile.mkstemp(prefix="paraloom-test-store-")
        os.close(fd)
        os.unlink(store)
        self.store = store
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, self.size, store, child), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)

    def run(self, fn, *args, timeout: float = RUN_TIMEOUT_S) -> list:
        if not self.procs:
            self._start()
        for conn in self.conns:
            conn.send((fn, args))
        results, errors = [None] * self.size, {}
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self.conns):
            # once one rank failed, the others get a short grace period (they may be blocked
            # in a collective with it)
            left = (deadline - time.monotonic() if not errors
                    else min(5.0, deadline - time.monotonic()))
            if conn.poll(max(left, 0.0)):
                status, value = pickle.loads(conn.recv_bytes())
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            else:
                errors[rank] = "no answer in time (hung or waiting on a failed rank)"
        if errors:
            self.close()
            report = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)}:\n{report}")
        return results

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []
        if self.store is not None and os.path.exists(self.store):  # the file store's file
            os.unlink(self.store)
        self.store = None


# ------------------------------------------------------------------------------- test tiers
SLOW = {
    "test_megatron_step.py": "megatron-core's own step on 4 CPU ranks, nine layouts (~75 s)",
    "test_diagnose.py": "every hang class diagnosed live on 4 ranks, waiting out timeouts (~60 s)",
    "test_megatron_lm.py": "Megatron-LM's pretrain_gpt on CPU ranks (~15 s a rank to import)",
    "test_training.py": "a fresh world per 3D layout, each trained and compared (~35 s)",
    "test_record.py": "recorded programs started as real processes, failures waited out (~35 s)",
    "test_multinode.py": "two torchrun agents on loopback (~30 s)",
    "test_resume.py": "runs killed with SIGKILL and resumed (~25 s)",
    "test_training_bf16.py": "the 3D layouts again in bf16 (~15 s)",
    "test_flight_recorder.py": "hung programs run until torch's Flight Recorder dumps (~15 s)",
    "test_reliability.py": "faults injected into fresh worlds, ranks killed (~13 s)",
    "test_moe_training.py": "MoE runs trained, checked and resumed under other layouts (~9 s)",
    "test_megatron_moe.py": "megatron-core's MoE step on 4 CPU ranks, both dispatchers (~55 s)",
}
"""Test modules in the full tier only (``-m slow``), with why: ``pytest -m "not slow"`` is the
quick tier for the inner loop (about 2.5 minutes on 2 cores); ``pytest`` runs both, as CI does."""


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def world4():
    world = World(4)
    yield world
    world.close()


@pytest.fixture(scope="module")
def world2():
    world = World(2)
    yield world
    world.close()


def real_rows(g, p):
    """A gathered gradient of a vocabulary table (padded to a multiple of 128 * tp rows, so its
    padding differs between layouts) cut to the real vocabulary, after checking that the
    padding rows got no gradient; any other tensor unchanged."""
    rows = getattr(p, "vocab_rows", None)
    if rows is None:
        return g
    assert not g[rows:].any(), "a padding row of the vocabulary got a gradient"
    return g[:rows]


def checkpoint_folder(run, cfg, step: int = 1):
    """A run folder holding a checkpoint's metadata only (``meta.json`` and an empty DCP
    ``.metadata``): enough for everything that reads a checkpoint's settings before ranks start
    (``--resume`` flags, the model comparison), nothing to load tensors from."""
    import json
    from pathlib import Path

    from paraloom.training.checkpoint import FORMAT
    ckpt = Path(run) / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "tokens": 0, "optimizer_steps": step,
                                                "config": cfg.to_dict(), "format": FORMAT}))
    return Path(run)


# ------------------------------------------------ "train this layout, compare with one process"
def train_rank(rank: int, world: int, cfg, t0: float) -> None:
    """The rank function of :func:`run_training`: paraloom's real training loop."""
    from paraloom.training.loop import run_rank
    run_rank(cfg, t0)


def metrics(out) -> list[dict]:
    """A run folder's ``metrics.jsonl``, one dict per step."""
    from paraloom.run_folder import METRICS, read_json_lines
    return read_json_lines(os.path.join(out, METRICS))


def layout_config(base, out, *, tp=1, cp=1, pp=1, dp=1, ep=1, vpp=None, sp=False, comm="p2p",
                  schedule=None, cp_sizes=None, **changes):
    """``base`` (a TrainConfig) under the layout given, writing to ``out``; the schedule follows
    the layout unless given, other settings by name (``lr=...``, ``recompute=...``)."""
    from paraloom.config import ParallelConfig
    parallel = ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, vpp=vpp, sequence_parallel=sp,
                              cp_comm_type=comm, cp_sizes=cp_sizes)
    return base.replace(parallel=parallel, schedule=schedule, out=str(out), **changes)


def run_training(cfg, timeout_s: float = 60.0) -> list[dict]:
    """Train ``cfg`` on its own local ranks (forked from this process); its metrics."""
    from paraloom import launch
    launch.spawn(train_rank, cfg.parallel.world_size, cfg, time.time(), timeout_s=timeout_s)
    return metrics(cfg.run.out)


def assert_same_metrics(got: list[dict], want: list[dict], rtol: float = 1e-5) -> None:
    """Same steps, and the same loss and gradient norm at each, within ``rtol``."""
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=rtol), (a, b)


@pytest.fixture
def no_ranks(monkeypatch):
    """Make starting a rank fail the test: "refused before any rank starts" is checked."""
    from paraloom import launch

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started for input that should be refused before")
    monkeypatch.setattr(launch, "spawn", refuse)
