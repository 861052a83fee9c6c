"""Cross-entropy over vocabulary-parallel logits: no rank ever holds the full ``[.., V]`` logits.

Forward, on logits ``[.., V/tp]`` split like :class:`VocabParallelEmbedding`:

1. all-reduce (MAX) of each token's local maximum, for a stable softmax;
2. one all-reduce (SUM) of three per-token numbers stacked together: the target's logit (only
   its owner contributes), the sum of exponentials, and, for label smoothing, the sum of logits;
3. ``loss = log(sum_exp) - target_logit``; with label smoothing ``eps``,
   ``(1 - eps) * loss + eps * (log(sum_exp) - sum_logits / V)`` with the *global* ``V``.

That last term is where Megatron-Core goes wrong for tp > 1 (Megatron-LM issue 737: the mean is
taken over the local vocabulary); here it equals ``F.cross_entropy(label_smoothing=eps)`` for any
tp. Backward needs no communication: ``softmax - (1 - eps) onehot - eps / V``, times the incoming
gradient.
"""

from __future__ import annotations

import torch

from .. import comm
from ..mesh import Axis

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axis, label_smoothing, module):
        where = dict(phase="forward", kind="tp", module=module,
                     split="logits, vocabulary range")
        logits = logits.float()
        vocab_local = logits.shape[-1]
        vocab = vocab_local * axis.size
        start = axis.rank * vocab_local

        logits_max = logits.amax(dim=-1)
        comm.all_reduce(logits_max, axis, op="max", site="vocab_parallel_cross_entropy.forward:max",
                        **where)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = shifted.exp()
        stats = [target_logit, exp.sum(-1)]
        if label_smoothing > 0:
            stats.append(shifted.sum(-1))
        stats = torch.stack(stats)
        comm.all_reduce(stats, axis, site="vocab_parallel_cross_entropy.forward:sums", **where)
        log_sum_exp = stats[1].log()
        loss = log_sum_exp - stats[0]
        if label_smoothing > 0:
            loss = ((1.0 - label_smoothing) * loss
                    + label_smoothing * (log_sum_exp - stats[2] / vocab))

        softmax = exp.div_(stats[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reused in place: it is not needed again
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - eps) * inside.unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 axis: Axis | None = None, label_smoothing: float = 0.0,
                                 module: str | None = "output") -> torch.Tensor:
    """Per-token loss ``[..]`` from logits ``[.., V/tp]`` split over ``axis`` (the tp axis).

    Equals ``F.cross_entropy(full_logits, target, reduction="none", label_smoothing=...)``;
    computed in fp32 whatever the logits' dtype.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if axis is None:
        from ..parallel_state import get_mesh
        axis = get_mesh().tp
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, axis,
                                            float(label_smoothing), module)
