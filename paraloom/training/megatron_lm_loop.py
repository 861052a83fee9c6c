"""What Megatron-LM's training loop communicates beyond the model step (``--megatron-lm-loop``).

Megatron-LM's ``pretrain`` wraps Megatron-Core's step in a loop that communicates on its own;
with ``--megatron-lm-loop`` ``paraloom train`` issues the same collectives at the same places, so
its record equals Megatron-LM's (``tests/test_megatron_lm.py``):

* :func:`broadcast_batch` -- ``get_batch_on_this_tp_rank``: every microbatch, on the stages that
  read data, tp rank 0 broadcasts the batch over the tensor-parallel group, one broadcast per
  tensor in Megatron's order: at pp = 1 tokens, labels (int64 ``[b, s]``), loss mask (fp32
  ``[b, s]``), position ids (int64 ``[b, s]``) and the attention mask (bool ``[b, 1, s, s]``);
  on the first stage tokens, position ids and the mask; on the last stage labels, loss mask
  and the mask. paraloom's data are the same on every tp rank (a pure function of seed and
  step), so what arrives is what each rank had; the traffic is Megatron-LM's.
* :func:`rerun_vote` -- the rerun state machine (``--rerun-mode validate_results``, Megatron-LM's
  default) asks every rank after forward-backward whether to re-run the step: an int32 ``[1]``
  all-reduce over the world. ``--rerun-mode disabled`` leaves it out.
* :func:`learning_rate_max` -- ``training_log`` takes the learning rate's maximum over the
  model-parallel group every iteration: fp32 ``[1]``.
* :func:`timer_barriers` -- in a logged iteration (the process's first, and every
  ``--log-interval``-th: 100 by default, as in Megatron-LM) the interval timer stops and
  restarts with a barrier over the world each; after the last iteration ``pretrain`` prints
  "after training is done" behind one more (:func:`training_done_barrier`).
* :func:`exit_vote` -- with ``--exit-duration-in-mins`` (with or without the loop: it is how
  the run stops), ``checkpoint_and_decide_exit`` after every iteration: whether any rank has
  run that long, an int32 ``[1]`` MAX all-reduce over the world; if so the run saves and stops
  (Megatron-LM then passes two more barriers and exits, without "after training is done";
  paraloom's stop is its own: its checkpoint and held-out loss).

:func:`after_step` runs the ones after the optimizer step in Megatron-LM's order.
"""

from __future__ import annotations

import time

import torch

from .. import comm
from ..mesh import ParallelMesh

__all__ = ["broadcast_batch", "rerun_vote", "learning_rate_max", "timer_barriers",
           "logged_iteration", "training_done_barrier", "exit_vote", "after_step"]

_SITE = "get_batch_on_this_tp_rank"


_SPLITS = {"tokens": "the microbatch's tokens", "labels": "the microbatch's labels",
           "loss mask": "the microbatch's loss mask",
           "position ids": "the microbatch's position ids",
           "attention mask": "the microbatch's attention mask"}


def _send(tensor: torch.Tensor, mesh: ParallelMesh, what: str) -> torch.Tensor:
    """One tensor of the batch from tp rank 0 (phase ``data``: reading the batch, outside the
    model's forward, where a recorded Megatron-LM run says ``other``)."""
    return comm.broadcast(tensor, mesh.tp, src=mesh.tp.ranks[0], phase="data", kind="tp",
                          site=f"{_SITE}:{what.replace(' ', '_')}", split=_SPLITS[what])


def broadcast_batch(tokens: torch.Tensor, labels: torch.Tensor, mesh: ParallelMesh, *,
                    first: bool, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The microbatch ``(tokens, labels)`` (``[b, s]``) as tp rank 0 holds it, broadcast the
    way Megatron-LM's ``get_batch_on_this_tp_rank`` does on a stage that is ``first`` and/or
    ``last``; nothing on a middle stage or without tensor parallelism."""
    if mesh.tp.size == 1 or not (first or last):
        return tokens, labels
    b, s = tokens.shape
    device = tokens.device
    positions = torch.arange(s, device=device).expand(b, s).contiguous()
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=device)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=device).tril_().logical_not_()
    tokens, labels = tokens.to(torch.int64).contiguous(), labels.to(torch.int64).contiguous()
    if first and last:
        order = (("tokens", tokens), ("labels", labels), ("loss mask", loss_mask),
                 ("position ids", positions), ("attention mask", mask))
    elif first:
        order = (("tokens", tokens), ("position ids", positions), ("attention mask", mask))
    else:
        order = (("labels", labels), ("loss mask", loss_mask), ("attention mask", mask))
    for what, tensor in order:
        _send(tensor, mesh, what)
    return tokens, labels


def rerun_vote(mesh: ParallelMesh, device: torch.device) -> None:
    """The rerun state machine's question after forward-backward: does any rank want the step
    re-run? (int32 ``[1]``, summed over the world; paraloom's answer is always no.)"""
    vote = torch.zeros(1, dtype=torch.int32, device=device)
    comm.all_reduce(vote, mesh.world, phase="optimizer", kind="world",
                    site="rerun_state_machine:vote", split="whether any rank re-runs the step")


def learning_rate_max(mesh: ParallelMesh, lr: float, device: torch.device) -> None:
    """``training_log``'s learning rate, its maximum over the model-parallel group."""
    value = torch.tensor([lr], dtype=torch.float32, device=device)
    comm.all_reduce(value, mesh.mp, op="max", phase="optimizer", kind="mp",
                    site="training_log:learning_rate", split="the learning rate, for the log")


def logged_iteration(iteration: int, log_interval: int, first: bool) -> bool:
    """Whether Megatron-LM logs ``iteration`` (counted from 1): the ``first`` of the process
    (also after a resume), and every ``log_interval``-th."""
    return first or iteration % log_interval == 0


def timer_barriers(mesh: ParallelMesh) -> None:
    """The interval timer's stop and start, each with a barrier over the world."""
    for what in ("stop", "start"):
        comm.barrier(mesh.world, phase="optimizer", site=f"training_log:interval_timer_{what}")


def training_done_barrier(mesh: ParallelMesh) -> None:
    """``pretrain``'s ``print_datetime("after training is done")``: a barrier over the world."""
    comm.barrier(mesh.world, phase="optimizer", site="pretrain:after_training_is_done")


def exit_vote(mesh: ParallelMesh, minutes: float, started: float, device: torch.device) -> bool:
    """Whether any rank has run ``minutes`` since ``started`` (the launch): Megatron-LM's
    ``--exit-duration-in-mins`` check, an int32 MAX all-reduce over the world."""
    late = torch.tensor([time.time() - started > 60.0 * minutes], dtype=torch.int32,
                        device=device)
    comm.all_reduce(late, mesh.world, op="max", phase="optimizer", kind="world",
                    site="checkpoint_and_decide_exit:exit_duration",
                    split="whether any rank has run --exit-duration-in-mins")
    return bool(late.item())


def after_step(mesh: ParallelMesh, cfg, step: int, first: bool, lr: float, started: float,
               device: torch.device) -> bool:
    """What Megatron-LM's loop communicates after iteration ``step + 1``'s optimizer step, in
    its order (``first``: the process's first iteration): ``training_log`` (the learning rate,
    the timers' barriers in a logged iteration), the exit vote, and after the last iteration
    the barrier of "after training is done"; the loop's collectives only with
    ``--megatron-lm-loop``. Returns whether the run stops here (the exit vote said so)."""
    loop = cfg.megatron_lm_loop
    if loop:
        learning_rate_max(mesh, lr, device)
        if logged_iteration(step + 1, cfg.run.log_interval, first):
            timer_barriers(mesh)
    minutes = cfg.run.exit_duration_mins
    stop = minutes is not None and exit_vote(mesh, minutes, started, device)
    if loop and step + 1 == cfg.steps and not stop:
        training_done_barrier(mesh)
    return stop
