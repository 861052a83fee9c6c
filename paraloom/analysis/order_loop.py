"""Megatron-LM's loop after the optimizer step, as rows of ``paraloom plan --table``
(:mod:`.order`; what is issued: :mod:`paraloom.training.megatron_lm_loop`): ``training_log``'s
learning rate (over the model-parallel group) and its timers' barriers (step 1 is logged), the
``--exit-duration-in-mins`` vote, and after a last step the barrier of "after training is
done"."""

from __future__ import annotations

__all__ = ["train_step_rows", "after_step_rows", "batch_rows"]

_BATCH = (("tokens", "the microbatch's tokens"), ("labels", "the microbatch's labels"),
          ("loss_mask", "the microbatch's loss mask"),
          ("position_ids", "the microbatch's position ids"),
          ("attention_mask", "the microbatch's attention mask"))
_FIRST = ("tokens", "position_ids", "attention_mask")
_LAST = ("labels", "loss_mask", "attention_mask")


def batch_rows(cfg, pre: bool, post: bool) -> list[dict]:
    """Megatron-LM's ``get_batch_on_this_tp_rank`` (kind, op, site, split, shape): the
    microbatch's tensors broadcast over tp from its rank 0, on a chunk that reads data (the first
    stage the inputs, the last the targets, one alone all of them)."""
    if not (pre or post):
        return []
    b, s = cfg.micro_batch_size, cfg.model.seq_length
    wanted = _FIRST if pre and not post else _LAST if post and not pre else None
    return [dict(kind="tp", op="broadcast", site=f"get_batch_on_this_tp_rank:{what}",
                 split=split, shape=[b, 1, s, s] if what == "attention_mask" else [b, s])
            for what, split in _BATCH if wanted is None or what in wanted]


def train_step_rows(cfg, pp_rank: int) -> list[dict]:
    """What Megatron-LM's ``train_step`` issues after ``optimizer.step()`` on a rank of pipeline
    stage ``pp_rank`` (:mod:`paraloom.training.step_stats`): the update flag, the gradient norm
    and with ``--log-num-zeros-in-grad`` the zero count agreed over mp; on the last stage the
    loss over dp x cp; then ``--log-params-norm``'s all-reduces."""
    p, one, rows = cfg.parallel, dict(shape=[1]), []
    agreed = [("update_successful", "whether this rank updated"), ("grad_norm",
                                                                     "the gradient norm")]
    if cfg.run.log_num_zeros_in_grad:
        agreed.append(("num_zeros", "the count of zero gradients"))
    if p.tp * p.pp > 1:
        rows += [dict(kind="mp", op="all_reduce", site=f"train_step:{tag}", split=split, **one)
                 for tag, split in agreed]
    if pp_rank == p.pp - 1 and p.dp * p.cp > 1:
        rows.append(dict(kind="dp", op="all_reduce", site="train_step:loss", shape=[2],
                         split="loss sum and token count"))
    if cfg.run.log_params_norm:
        shards = dict(op="all_reduce", site="calc_params_l2_norm:sharded_norm", **one,
                      split="squared norm of this rank's parameter shards")
        rows += [dict(kind=kind, **shards) for kind, size in (
            ("dp", p.dp * p.cp), ("dp", p.dp * p.cp), ("edp", p.dp * p.cp // p.ep),
            ("edp", p.dp * p.cp // p.ep)) if size > 1]
        rows += [dict(kind=kind, op="all_reduce", site="calc_params_l2_norm:model_parallel",
                      split="squared parameter norm of this rank's model part", **one)
                 for kind, size in (("mp", p.tp * p.pp), ("tp_ep_pp", p.tp * p.pp * p.ep))
                 if size > 1 and (kind == "mp" or p.ep > 1)]
    return rows


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
