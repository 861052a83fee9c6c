"""What the recorder knows of Megatron-Core's training step (with or without ``--megatron-on-cpu``).

Megatron drives its step from Python code that runs outside any module's forward and outside
autograd, where the tracker alone would say ``other``. Four places tell what that code does,
and each is wrapped when its module is imported (:mod:`.on_import`; nothing is imported for it,
and a program without Megatron is untouched):

* ``pipeline_parallel/p2p_communication.py``: ``_batched_p2p_ops`` and ``_p2p_ops`` get the four
  tensors by role. ``tensor_send_next`` / ``tensor_recv_prev`` are activations (phase
  ``forward``), ``tensor_send_prev`` / ``tensor_recv_next`` their gradients (``backward``); each
  tensor is tagged for the send or receive that follows (:func:`.pipeline.tag`).
* ``pipeline_parallel/schedules.py``: entering one of the ``forward_backward_*`` schedules
  begins an iteration (the schedule calls the data iterator, whose broadcasts belong to the step,
  before the model's first forward).
* ``optimizer/``: every ``MegatronOptimizer`` class's own ``step()`` is phase ``optimizer`` (the
  grad norm, the update flag, the distributed optimizer's parameter all-gathers after the inner
  torch step), and so is ``distributed/finalize_model_grads.finalize_model_grads`` (the
  data-parallel wait, the tied-embedding and sequence-parallel all-reduces).
* ``distributed/param_and_grad_buffer.py``: a bucket group's ``start_grad_sync`` outside those
  regions is phase ``backward`` (Megatron's schedule launches the last stage's reduction after
  its last ``send_backward`` with ``--align-grad-reduce``, between autograd runs); inside
  ``finalize_model_grads`` (the first iteration, or without overlap) it stays ``optimizer``.
  Its ``start_param_sync`` outside those regions, unless forced, is phase ``forward``: the
  parameter all-gathers of ``--overlap-param-gather`` that the interleaved schedule launches
  (``--align-param-gather``) ahead of the forward steps, between module calls (the forward
  pre-hooks' are in a forward already); a forced sync (before a checkpoint) stays ``other``,
  and the chained optimizer's dispatch (``--overlap-param-gather-with-optimizer-step``)
  ``optimizer``.
"""

from __future__ import annotations

import functools
import sys

from . import on_import, pipeline

__all__ = ["install", "uninstall", "MODULES"]

_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_OPTIMIZERS = "megatron.core.optimizer."
_FINALIZE = "megatron.core.distributed.finalize_model_grads"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
MODULES = (_P2P, _SCHEDULES, _OPTIMIZERS, _FINALIZE, _BUFFER)
"""The modules (``.``: a package's modules) whose functions are wrapped."""
_ROLES = (("tensor_send_next", "forward"), ("tensor_recv_prev", "forward"),
          ("tensor_send_prev", "backward"), ("tensor_recv_next", "backward"))

_TRACKER = None  # the active recorder's Tracker
_SAVED: list[tuple[object, str, object]] = []  # (owner, attribute, original)


def _wrap(owner, name: str, make) -> None:
    orig = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if orig is None or getattr(orig, "__paraloom_wrapped__", False):
        return
    wrapped = functools.wraps(orig)(make(orig))
    wrapped.__paraloom_wrapped__ = True
    _SAVED.append((owner, name, orig))
    setattr(owner, name, wrapped)


def _tagging(orig):
    def p2p(*args, **kwargs):
        for key, phase in _ROLES:
            tensor = kwargs.get(key)
            if tensor is not None and _TRACKER is not None:
                pipeline.tag(tensor, phase)
        return orig(*args, **kwargs)
    return p2p


def _beginning(orig):
    def schedule(*args, **kwargs):
        if _TRACKER is not None:
            _TRACKER.iteration_begins()
        return orig(*args, **kwargs)
    return schedule


def _region(phase: str, only_outside: bool = False):
    def make(orig):
        def run(*args, **kwargs):
            tracker = _TRACKER
            if tracker is None or (only_outside and tracker.in_region()):
                return orig(*args, **kwargs)
            tracker.enter(phase)
            try:
                return orig(*args, **kwargs)
            finally:
                tracker.leave()
        return run
    return make


def _p2p(module) -> None:
    for name in ("_batched_p2p_ops", "_p2p_ops"):
        _wrap(module, name, _tagging)


def _schedules(module) -> None:
    for name in [n for n in vars(module) if n.startswith("forward_backward_")]:
        if callable(getattr(module, name)):
            _wrap(module, name, _beginning)


def _optimizers(module) -> None:
    base = sys.modules.get("megatron.core.optimizer.optimizer")
    base = getattr(base, "MegatronOptimizer", None)
    if base is None:
        return
    for value in list(vars(module).values()):
        if isinstance(value, type) and issubclass(value, base) \
                and value.__module__ == module.__name__ and "step" in value.__dict__:
            _wrap(value, "step", _region("optimizer"))


def _finalize(module) -> None:
    _wrap(module, "finalize_model_grads", _region("optimizer"))


def _gathering(orig):
    forward = _region("forward", only_outside=True)(orig)

    def start_param_sync(self, force_sync: bool = False, *args, **kwargs):
        run = orig if force_sync else forward
        return run(self, force_sync, *args, **kwargs)
    return start_param_sync


def _buffer(module) -> None:
    group = getattr(module, "_ParamAndGradBucketGroup", None)
    if group is not None:
        _wrap(group, "start_grad_sync", _region("backward", only_outside=True))
        _wrap(group, "start_param_sync", _gathering)


_HOOKS = ((_P2P, _p2p), (_SCHEDULES, _schedules), (_OPTIMIZERS, _optimizers),
          (_FINALIZE, _finalize), (_BUFFER, _buffer))


def install(tracker) -> None:
    """Wrap Megatron-Core's step functions for ``tracker`` (now, or when they are imported)."""
    global _TRACKER
    _TRACKER = tracker
    for name, hook in _HOOKS:
        on_import.after_import(name, hook)


def uninstall() -> None:
    global _TRACKER
    _TRACKER = None
    for name, hook in _HOOKS:
        on_import.forget(name, hook)
    for owner, name, orig in reversed(_SAVED):
        setattr(owner, name, orig)
    _SAVED.clear()
