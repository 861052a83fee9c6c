"""Record the communication of any PyTorch program: ``record_comms`` and ``paraloom record``.

The one part of paraloom that observes ``torch.distributed`` from outside (everything else
communicates through :mod:`paraloom.comm`). See :mod:`.intercept` for where it hooks in and why.
"""

from .recorder import Recorder, mark_step, record_comms

__all__ = ["record_comms", "Recorder", "mark_step"]
