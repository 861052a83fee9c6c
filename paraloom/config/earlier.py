"""What earlier paraloom versions meant by a saved ``config.json`` (in this version's nested
layout): each setting whose default or meaning changed since, given its old value explicitly."""

from __future__ import annotations

__all__ = ["earlier_meanings"]


def earlier_meanings(out: dict) -> dict:
    """``out`` (a nested ``config.json`` dict, changed in place and returned) with the values
    earlier versions used for settings they did not write or meant otherwise."""
    if "megatron_lm_loop" not in out and "parallel" in out:  # written before the loop existed
        out["megatron_lm_loop"] = False
    run = out.get("run")
    if isinstance(run, dict) and "log_interval" in run and "tensorboard_log_interval" not in run:
        # earlier versions: log_interval was TensorBoard's interval (now Megatron-LM's meaning)
        run["tensorboard_log_interval"] = run.pop("log_interval")
    model = out.get("model")
    if isinstance(model, dict) and model.get("num_experts"):  # before allgather: alltoall only
        model.setdefault("moe_token_dispatcher_type", "alltoall")
    return out
