"""``torch.distributed.pipelining`` as the recorder sees it.

* **Phase of the stages' p2p.** Pipelining posts its sends and receives from the schedule's loop,
  between module calls and outside the autograd engine, where the tracker's phase would be
  ``other``. Each is made by a stage method whose role is its name: ``get_fwd_send_ops`` /
  ``get_fwd_recv_ops`` (activations, phase ``forward``) and ``get_bwd_send_ops`` /
  ``get_bwd_recv_ops`` (their gradients, ``backward``). Those methods are wrapped to tag each
  op's tensor; the recorder reads the tag when the send or receive launches
  (:func:`p2p_phase`). The stage module is patched when it is imported (:mod:`.on_import`:
  importing pipelining up front would cost every record a second), or at once if the program
  imported it already. Megatron-Core's schedules tag theirs the same way
  (:mod:`.megatron_step`). The shape exchange at a stage's first step has no role: ``other``.
* **Compute spans** (with ``--compute``): each stage's ``forward_one_chunk`` /
  ``backward_one_chunk`` is one span with paraloom's pipeline sites (``pipeline.forward`` /
  ``pipeline.backward``), its ``stage`` and its ``microbatch`` (the chunk id), so ``paraloom
  schedule`` can draw a recorded pipeline. A Python-level wrap is enough for both: nothing else
  runs a stage's chunk or makes its p2p ops.
"""

from __future__ import annotations

import functools
import sys

from . import on_import

__all__ = ["install", "uninstall", "install_phases", "uninstall_phases", "p2p_phase", "tag"]

_STAGE = "torch.distributed.pipelining.stage"
_ROLES = (("get_fwd_send_ops", "forward"), ("get_fwd_recv_ops", "forward"),
          ("get_bwd_send_ops", "backward"), ("get_bwd_recv_ops", "backward"))
_SAVED: dict = {}  # compute spans: method name -> original
_TAGGERS: dict = {}  # p2p phases: method name -> original
_PHASES: dict[int, str] = {}  # data_ptr of a made op's tensor -> its phase, until it launches


def p2p_phase(tensor) -> str | None:
    """The phase of the pipelining op that sends or receives ``tensor`` (forgotten once read)."""
    return _PHASES.pop(tensor.data_ptr(), None) if _PHASES else None


def tag(tensor, phase: str) -> None:
    """Say that the next send or receive of ``tensor`` is of ``phase`` (its schedule knows)."""
    _PHASES[tensor.data_ptr()] = phase


def _tagging(orig, phase: str):
    @functools.wraps(orig)
    def make_ops(stage, *args, **kwargs):
        ops = orig(stage, *args, **kwargs)
        for op in ops:
            _PHASES[op.tensor.data_ptr()] = phase
        return ops
    return make_ops


def _tag_stage(module) -> None:
    stage = getattr(module, "_PipelineStageBase", None)
    if stage is None or _TAGGERS:
        return
    for name, phase in _ROLES:
        orig = getattr(stage, name, None)
        if orig is not None:
            _TAGGERS[name] = orig
            setattr(stage, name, _tagging(orig, phase))


def install_phases() -> None:
    """Tag pipelining's p2p ops from now on (now if the stage module is loaded, else on its
    import)."""
    on_import.after_import(_STAGE, _tag_stage)


def uninstall_phases() -> None:
    on_import.forget(_STAGE, _tag_stage)
    module = sys.modules.get(_STAGE)
    if module is not None:
        for name, orig in _TAGGERS.items():
            setattr(module._PipelineStageBase, name, orig)
    _TAGGERS.clear()
    _PHASES.clear()


def _wrap(orig, site: str, phase: str, ledger, recording):
    @functools.wraps(orig)
    def run(stage, chunk_id, *args, **kwargs):
        if not recording():
            return orig(stage, chunk_id, *args, **kwargs)
        event = ledger.record(op="compute", phase=phase, kind="compute", site=site,
                              stage=stage.stage_index)
        event["microbatch"] = chunk_id
        try:
            return orig(stage, chunk_id, *args, **kwargs)
        finally:
            event["t_wait"] = event["t_end"] = ledger.stamp()
    return run


def install(ledger, recording=lambda: True) -> None:
    """Wrap the stage methods (imports torch.distributed.pipelining; only with ``compute``);
    a chunk run while ``recording()`` is false gets no span."""
    from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

    for name, site, phase in (("forward_one_chunk", "pipeline.forward", "forward"),
                              ("backward_one_chunk", "pipeline.backward", "backward")):
        orig = _SAVED.setdefault(name, getattr(Stage, name))
        setattr(Stage, name, _wrap(orig, site, phase, ledger, recording))


def uninstall() -> None:
    if not _SAVED:
        return
    from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

    for name, orig in _SAVED.items():
        setattr(Stage, name, orig)
    _SAVED.clear()
