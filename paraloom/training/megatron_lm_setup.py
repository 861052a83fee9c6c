"""What Megatron-LM communicates before its first iteration (``--megatron-lm-loop``).

``pretrain`` (Megatron-LM's ``megatron/training/training.py``, driven by ``pretrain_gpt.py``)
synchronises its ranks many times before the first forward: every ``print_datetime`` is a barrier
over the world, every timer started with ``barrier=True`` is one more, ``timers.log`` gathers
each rank's elapsed times, and the start-up clock is agreed by all-reduces. With
``--megatron-lm-loop`` ``paraloom train`` issues the same collectives in the same order, in its
ledger's ``setup`` section, so ``paraloom diff --step setup`` of a recorded Megatron-LM run and
of ``paraloom train`` given its command line is empty (``tests/test_megatron_lm.py``). Each is
what paraloom does at that point of its own set-up, labelled with the Megatron-LM call it stands
for; the values are paraloom's (its clock, its parameter groups, its data flags).

In Megatron-LM's order (every collective over the world but the tied embeddings' one):

1. :func:`initialize` -- ``initialize_megatron``'s barrier after compiling its helpers; the
   program's and the training's start times, fp64 ``[1]`` minima over the world (``pretrain``
   with ``set_startup_timestamps``, as ``pretrain_gpt.py`` calls it); two ``print_datetime``
   barriers; ``timers.log`` of the ten start-up timers (a barrier and an fp32 ``[10]``
   all-gather); ``print_datetime("after megatron is initialized")``; the model-and-optimizer
   timer's start barrier.
2. The model: the tied word embeddings' all-reduce over the embedding group
   (:meth:`paraloom.models.GPTModel.setup_embeddings_and_output_layer`, on the stages that hold
   them).
3. :func:`param_groups` -- ``_get_param_groups``' ``all_gather_object`` of the parameter-group
   keys, once for the dense and once for the expert parameters: an int64 ``[1]`` size and a
   uint8 payload each.
4. :func:`data_setup` -- ``print_datetime`` after the model; the data-iterator timer's start
   barrier; per model chunk, the dataset builder's barrier for each split (train, valid, test)
   and the int64 ``[3]`` broadcast of the do-train/valid/test flags from rank 0;
   ``print_datetime`` after the data loaders; ``timers.log`` of the two set-up timers (a barrier
   and an fp32 ``[2]`` all-gather); the interval timer's start barrier; and
   ``print_datetime("before the start of training step")``.

Not here: what Megatron-LM does with ``--load`` (its checkpoint timers), with evaluation at
iteration 0, or in-process restart; paraloom's own agreements before set-up (the run folder, the
clock of the launch), which are the launcher's, not the job's, and stay off the record.
"""

from __future__ import annotations

import pickle
import time

import torch

from .. import comm
from ..data_parallel import no_weight_decay_cond
from ..mesh import ParallelMesh

__all__ = ["initialize", "param_groups", "data_setup", "STARTUP_TIMERS", "SPLITS"]

STARTUP_TIMERS = 10
"""The start-up timers ``pretrain`` logs when the script registered its start-up timestamps."""

SPLITS = ("train", "valid", "test")
"""The datasets Megatron-LM's builder makes (a barrier each), per model chunk."""


def _print_datetime(mesh: ParallelMesh, when: str) -> None:
    comm.barrier(mesh.world, phase="setup", site=f"print_datetime:{when.replace(' ', '_')}")


def _timer_start(mesh: ParallelMesh, name: str) -> None:
    comm.barrier(mesh.world, phase="setup", site=f"Timer.start:{name}")


def _timers_log(mesh: ParallelMesh, elapsed: list[float], what: str, device) -> None:
    """``timers.log(names, barrier=True)``: a barrier, then every rank's elapsed times."""
    comm.barrier(mesh.world, phase="setup", site=f"timers.log:{what}")
    times = torch.tensor(elapsed, dtype=torch.float32, device=device)
    comm.all_gather(times, mesh.world, phase="setup",
                    kind="world", site=f"timers.log:{what}",
                    split=f"each rank's {what} times, for the log")


def initialize(mesh: ParallelMesh, started: float, device: torch.device) -> None:
    """Megatron-LM's collectives from ``initialize_megatron`` up to the model's construction;
    ``started``: this process's start (``time.time()``)."""
    comm.barrier(mesh.world, phase="setup", site="initialize_megatron:compile_dependencies")
    for what, t in (("program", started), ("training", time.time())):
        clock = torch.tensor([t], dtype=torch.float64, device=device)
        comm.all_reduce(clock, mesh.world, op="min", phase="setup", kind="world",
                        site=f"pretrain:{what}_start_time",
                        split=f"the earliest {what} start over the ranks")
    _print_datetime(mesh, "after in-process setup")
    _print_datetime(mesh, "after in-job setup")
    _timers_log(mesh, [time.time() - started] * STARTUP_TIMERS, "start-up", device)
    _print_datetime(mesh, "after megatron is initialized")
    _timer_start(mesh, "model-and-optimizer-setup")


def _group_keys(chunks) -> list:
    """Megatron's parameter-group keys of this rank's parameters, in order of first
    appearance: ``(overrides, is_expert_parallel)``, where the parameters without weight decay
    (biases, norms: :func:`~paraloom.data_parallel.no_weight_decay_cond`) carry
    ``(("wd_mult", 0.0),)`` and the others ``None``."""
    keys = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            expert = not getattr(param, "allreduce", True)
            key = ((("wd_mult", 0.0),) if no_weight_decay_cond(name, param) else None, expert)
            if key not in keys:
                keys.append(key)
    return keys


def param_groups(chunks, mesh: ParallelMesh, device: torch.device) -> None:
    """``_get_param_groups``' agreement on the parameter groups, made twice (for the dense
    optimizer, then the expert one; each keeps its own groups after): each rank's pickled keys
    of all its parameters, their size gathered first (int64 ``[1]``), then the payloads padded
    to the largest (uint8), as ``torch.distributed.all_gather_object`` sends them."""
    payload = pickle.dumps(_group_keys(chunks))
    for expert in (False, True):
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        what = "expert" if expert else "dense"
        sizes = comm.all_gather(size, mesh.world, phase="setup", kind="world",
                                site=f"_get_param_groups:{what}",
                                split=f"the size of each rank's {what} parameter-group keys")
        data = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        data[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        data = data.to(device)
        comm.all_gather(data, mesh.world, phase="setup", kind="world",
                        site=f"_get_param_groups:{what}",
                        split=f"each rank's {what} parameter-group keys")


def data_setup(mesh: ParallelMesh, chunks: int, started: float, device: torch.device, *,
               train: bool, evaluate: bool) -> None:
    """Megatron-LM's collectives from the built model to the first iteration: the data
    iterators of each of the ``chunks`` model chunks, the set-up log, the interval timer."""
    _print_datetime(mesh, "after model, optimizer, and learning rate scheduler are built")
    t_data = time.time()
    _timer_start(mesh, "train/valid/test-data-iterators-setup")
    for _ in range(chunks):
        for split in SPLITS:
            comm.barrier(mesh.world, phase="setup", site=f"dataset_builder:{split}")
        flags = torch.tensor([int(train), int(evaluate), int(evaluate)], dtype=torch.int64,
                             device=device)
        comm.broadcast(flags, mesh.world, src=0, phase="setup", kind="world",
                       site="build_train_valid_test_data_loaders:flags",
                       split="whether to train, validate and test")
    _print_datetime(mesh, "after dataloaders are built")
    _timers_log(mesh, [t_data - started, time.time() - t_data], "set-up", device)
    _timer_start(mesh, "interval-time")
    _print_datetime(mesh, "before the start of training step")
