"""Compute spans of ``torch.distributed.pipelining`` stages, so ``paraloom schedule`` can draw a
recorded pipeline: with ``--compute``, each stage's ``forward_one_chunk`` / ``backward_one_chunk``
is one span with paraloom's pipeline sites (``pipeline.forward`` / ``pipeline.backward``), its
``stage`` and its ``microbatch`` (the chunk id). A Python-level wrap is enough here: these are
compute spans, not communication, and nothing else runs a stage's chunk.
"""

from __future__ import annotations

import functools

__all__ = ["install", "uninstall"]

_SAVED: dict = {}


def _wrap(orig, site: str, phase: str, ledger):
    @functools.wraps(orig)
    def run(stage, chunk_id, *args, **kwargs):
        event = ledger.record(op="compute", phase=phase, kind="compute", site=site,
                              stage=stage.stage_index)
        event["microbatch"] = chunk_id
        try:
            return orig(stage, chunk_id, *args, **kwargs)
        finally:
            event["t_wait"] = event["t_end"] = ledger.now()
    return run


def install(ledger) -> None:
    """Wrap the stage methods (imports torch.distributed.pipelining; only with ``compute``)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

    for name, site, phase in (("forward_one_chunk", "pipeline.forward", "forward"),
                              ("backward_one_chunk", "pipeline.backward", "backward")):
        orig = _SAVED.setdefault(name, getattr(Stage, name))
        setattr(Stage, name, _wrap(orig, site, phase, ledger))


def uninstall() -> None:
    if not _SAVED:
        return
    from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

    for name, orig in _SAVED.items():
        setattr(Stage, name, orig)
    _SAVED.clear()
