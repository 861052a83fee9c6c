"""Megatron-LM's loop after the optimizer step, as rows of ``paraloom plan --table``
(:mod:`.order`; what is issued: :mod:`paraloom.training.megatron_lm_loop`): ``training_log``'s
learning rate (over the model-parallel group) and its timers' barriers (step 1 is logged), the
``--exit-duration-in-mins`` vote, and after a last step the barrier of "after training is
done"."""

from __future__ import annotations

__all__ = ["after_step_rows"]


def after_step_rows(cfg, model_parallel: int) -> list[dict]:
    """Step 1's rows (kind, op, site, split, shape) after the optimizer step, in launch order
    (``model_parallel``: tp x pp)."""
    loop, rows = cfg.megatron_lm_loop, []
    if loop and model_parallel > 1:
        rows.append(dict(kind="mp", op="all_reduce", site="training_log:learning_rate",
                         split="the learning rate, for the log", shape=[1]))
    if loop:
        rows += [dict(kind="world", op="barrier", site=f"training_log:interval_timer_{what}")
                 for what in ("stop", "start")]
    if cfg.run.exit_duration_mins is not None:
        rows.append(dict(kind="world", op="all_reduce",
                         site="checkpoint_and_decide_exit:exit_duration", shape=[1],
                         split="whether any rank has run --exit-duration-in-mins"))
    if loop and cfg.steps == 1:
        rows.append(dict(kind="world", op="barrier", site="pretrain:after_training_is_done"))
    return rows
