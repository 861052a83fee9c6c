"""Where a run writes, what it records and when it gives up: :class:`RunConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .fields import option
from .parallel import positive_int

__all__ = ["RunConfig", "DEFAULT_SAVE_EVERY"]


DEFAULT_SAVE_EVERY = 50
"""Steps between checkpoints when ``--save-every`` is not given."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where the run writes, what it records, and when it gives up."""

    out: str = option("runs/latest", "--out", "--save", help="run folder")
    """Run folder (config.json, metrics.jsonl, ledger.jsonl, trace.json, ...)."""
    save_every: int | None = option(
        None, "--save-every", "--save-interval",
        help=f"checkpoint every N steps and at the end (0: never; default {DEFAULT_SAVE_EVERY}, "
             f"or none when not every node sees the run folder, said in a note)")
    """Save a checkpoint every N steps (and at the end when N > 0). ``None`` (not given):
    :data:`DEFAULT_SAVE_EVERY` where every rank shares the run folder, else no checkpoints
    (:func:`paraloom.training.multinode.checkpoint_interval`)."""
    resume: str | None = option(None, "--resume", "--load", help="run or checkpoint folder")
    """Run folder or checkpoint folder to continue from."""
    init_from_hf: str | None = option(
        None, "--init-from-hf", metavar="DIR",
        help="start from a local Hugging Face GPT-2 or Llama checkpoint folder (config.json + "
             "model.safetensors or pytorch_model.bin); the model shape comes from its config, "
             "--seq-len may shorten it")
    """A Hugging Face folder whose weights replace the initial ones (stored absolute, so the
    run folder says where the model came from)."""
    ledger_steps: int = option(2, "--ledger-steps", help="steps recorded in the ledger (-1: all)")
    """Steps recorded in the ledger (from the first); -1 records every step."""
    timeout_s: float = option(120.0, "--timeout",
                              help="seconds any collective may wait before the run is ended")
    """Timeout for every collective wait; a dead or stuck rank ends the run after this long."""
    hang_after: float = option(
        60.0, "--hang-after", metavar="S",
        help="when every rank has been blocked in communication S seconds and the ranks "
             "disagree, stop them, print the diagnosis (paraloom diagnose) and exit 3 "
             "(default 60; 0 turns it off)")
    """Live hang watch (:mod:`paraloom.diagnose.watch`) over the recorded steps; 0: off."""
    max_bad_steps: int = option(3, "--max-bad-steps",
                                help="stop after this many consecutive NaN/Inf steps (each is "
                                     "skipped)")
    """Stop after this many consecutive steps with a NaN/Inf loss or gradient (each skipped)."""
    exit_duration_mins: float | None = option(
        None, "--exit-duration-in-mins", metavar="M",
        help="Megatron's: after each step the ranks agree (a MAX all-reduce over the world) "
             "whether any has run M minutes; then the run saves and stops")
    """Megatron-LM's ``--exit-duration-in-mins``: the wall-time limit from the launch, checked
    after every step (:func:`paraloom.training.megatron_lm_loop.exit_vote`)."""
    tensorboard_dir: str | None = option(
        None, "--tensorboard-dir", metavar="DIR",
        help="write loss, lr, grad norm, tokens/s and per-kind comm bytes as TensorBoard scalars")
    """Write TensorBoard scalars here (rank 0; Megatron's ``--tensorboard-dir``)."""
    log_interval: int = option(100, "--log-interval",
                               help="Megatron-LM's training log: with --megatron-lm-loop the first "
                                    "and every Nth iteration stop and restart the interval timer "
                                    "behind two barriers")
    """Megatron-LM's ``--log-interval``: the iterations ``training_log`` reports (the first, and
    every N-th), whose interval timer stops and restarts behind a barrier each
    (:mod:`paraloom.training.megatron_lm_loop`)."""
    tensorboard_log_interval: int = option(1, "--tensorboard-log-interval",
                                           help="TensorBoard scalars every N steps")
    """TensorBoard scalars every N steps (and at the last; Megatron-LM's
    ``--tensorboard-log-interval``)."""

    log_params_norm: bool = option(False, "--log-params-norm",
                                   help="Megatron-LM's parameter norm after every step (its "
                                        "sharded and model-parallel all-reduces; in metrics)")
    """Megatron-LM's ``calc_params_l2_norm`` after each step
    (:func:`paraloom.training.step_stats.params_norm`)."""
    log_num_zeros_in_grad: bool = option(False, "--log-num-zeros-in-grad",
                                         help="Megatron's count of zero gradients in the "
                                              "optimizer step (int64 all-reduce over the "
                                              "grad-stats group, then a MAX over mp)")
    """Megatron's ``count_zeros_fp32`` (:meth:`paraloom.data_parallel.clip_grads.GradNorm.
    count_zeros`)."""

    def __post_init__(self) -> None:
        if isinstance(self.ledger_steps, bool) or not isinstance(self.ledger_steps, int) or (
                self.ledger_steps < 1 and self.ledger_steps != -1):
            raise ValueError(f"ledger_steps (--ledger-steps) must be a positive number of steps "
                             f"or -1 (every step), got {self.ledger_steps!r}")
        if self.save_every is not None and self.save_every < 0:
            raise ValueError(f"save_every (--save-every) must be >= 0, got {self.save_every}")
        positive_int("max_bad_steps", self.max_bad_steps)
        positive_int("--log-interval", self.log_interval)
        positive_int("--tensorboard-log-interval", self.tensorboard_log_interval)
        if not (isinstance(self.hang_after, (int, float)) and self.hang_after >= 0
                and math.isfinite(self.hang_after)):
            raise ValueError(f"hang_after (--hang-after) must be 0 (off) or positive seconds, "
                             f"got {self.hang_after}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0
                and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s (--timeout) must be a positive number of seconds, got "
                             f"{self.timeout_s}")
        minutes = self.exit_duration_mins
        if minutes is not None and not (isinstance(minutes, (int, float)) and minutes > 0
                                        and math.isfinite(minutes)):
            raise ValueError(f"--exit-duration-in-mins must be a positive number of minutes, "
                             f"got {minutes}")
