"""TensorBoard scalars of a training run (Megatron's ``--tensorboard-dir`` /
``--tensorboard-log-interval``).

The last rank (it holds the loss: the last pipeline stage) writes, through
``torch.utils.tensorboard`` (the ``tensorboard`` package, an optional extra:
``pip install 'paraloom[tensorboard]'``), every ``log_interval`` steps and at the last:

* ``lm loss``, ``learning-rate``, ``grad-norm`` and ``throughput/tokens-per-second``;
* on every step the ledger records (``--ledger-steps``, all with ``-1``), ``comm-bytes/KIND``:
  the writing rank's communicated bytes of that step per kind (``tp``, ``sp``, ``pp``, ``dp``,
  ``emb``, ``mp``, ...), counted from the ledger, so exact rather than estimated.

The step axis is the iteration number (1-based, as Megatron's). :func:`check_tensorboard` runs
before ranks start so a missing package is a clear error, not a crash in a rank.
"""

from __future__ import annotations

__all__ = ["check_tensorboard", "ScalarLog", "TAGS"]

TAGS = ("lm loss", "learning-rate", "grad-norm", "throughput/tokens-per-second")
"""The per-interval scalar tags (the per-kind ``comm-bytes/KIND`` tags follow the ledger)."""


def check_tensorboard() -> None:
    """``ValueError`` saying how to install it when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as err:
        raise ValueError(f"--tensorboard-dir needs the tensorboard package ({err}): pip install "
                         f"'paraloom[tensorboard]' (or pip install tensorboard)") from None


class ScalarLog:
    """The run's scalar writer on the last rank; ``None``-safe to call only when enabled."""

    def __init__(self, log_dir: str, interval: int, total_steps: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir)
        self.interval, self.total = interval, total_steps

    def step(self, step: int, metrics: dict, tokens_per_s: float,
             events: list[dict] | None) -> None:
        """Write ``step``'s scalars (counted from 1); ``events``: this rank's ledger of the
        step, when it was recorded."""
        if step % self.interval == 0 or step == self.total:
            values = (metrics["loss"], metrics["lr"], metrics["grad_norm"], tokens_per_s)
            for tag, value in zip(TAGS, values, strict=True):
                self.writer.add_scalar(tag, float(value), step)
        if events:
            per_kind: dict[str, int] = {}
            for e in events:
                if e["op"] != "compute" and e["phase"] != "setup":
                    per_kind[e["kind"]] = per_kind.get(e["kind"], 0) + e["bytes"]
            for kind, nbytes in sorted(per_kind.items()):
                self.writer.add_scalar(f"comm-bytes/{kind}", nbytes, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
