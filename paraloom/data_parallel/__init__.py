"""Data parallelism: contiguous fp32 gradient buckets, overlapped reduction, ZeRO-1 optimizer."""

from .ddp import DistributedDataParallel
from .finalize import finalize_model_grads
from .grad_buffer import Bucket, GradBuffer, default_bucket_size
from .optimizer import (
    DistributedOptimizer,
    MainParamsOptimizer,
    adam_step_,
    adam_update_,
    no_weight_decay_cond,
)
from .param_gather import ParamGather, force_param_sync, paused

__all__ = ["DistributedDataParallel", "finalize_model_grads", "GradBuffer", "Bucket",
           "default_bucket_size", "DistributedOptimizer", "MainParamsOptimizer", "adam_step_",
           "adam_update_", "no_weight_decay_cond", "ParamGather", "force_param_sync",
           "paused"]
