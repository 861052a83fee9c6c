"""Cross-entropy over vocabulary-parallel logits: no rank ever holds the full ``[.., V]`` logits.

Forward, on logits ``[.., V/tp]`` split like :class:`VocabParallelEmbedding`:

1. all-reduce (MAX) of each token's local maximum, for a stable softmax;
2. all-reduce (SUM) of the target's logit (only its owner contributes);
3. all-reduce (SUM) of the sum of exponentials;
4. with label smoothing only, all-reduce (SUM) of the sum of logits;
5. ``loss = log(sum_exp) - target_logit``; with label smoothing ``eps``,
   ``(1 - eps) * loss + eps * (log(sum_exp) - sum_logits / V)`` with the *global* ``V``.

Steps 1-3 are Megatron-Core's three all-reduces, in its order, each an fp32 ``[s, b]`` tensor
(``_VocabParallelCrossEntropy.forward``). Step 4 is where Megatron-Core goes wrong for tp > 1
(Megatron-LM issue 737: it takes the mean over the local vocabulary, with no communication);
here the loss equals ``F.cross_entropy(label_smoothing=eps)`` for any tp, at the price of that
one more all-reduce (README, Defaults). Backward needs no communication:
``softmax - (1 - eps) onehot - eps / V``, times the incoming gradient.

``fused`` (Megatron's ``--cross-entropy-loss-fusion``, its native implementation
``fused_vocab_parallel_cross_entropy``): steps 2 and 3 are one all-reduce of the two
concatenated, ``[2s, b]`` (target logits first), and the logits' gradient is rounded to bf16
(Megatron's fused backward returns bf16 whatever the logits' dtype). No label smoothing there.
"""

from __future__ import annotations

import torch

from .. import comm
from ..mesh import Axis
from ..parallel_state import get_mesh

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axis, label_smoothing, module, vocab_size, fused):
        where = dict(phase="forward", kind="tp", module=module,
                     split="logits, vocabulary range")
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = axis.rank * vocab_local
        vocab = vocab_size or vocab_local * axis.size
        real = min(max(vocab - start, 0), vocab_local)  # this rank's columns that are not padding
        if real < vocab_local:  # padded vocabulary rows: never a class, probability 0
            logits = logits.clone()
            logits[..., real:] = float("-inf")

        logits_max = logits.amax(dim=-1)
        comm.all_reduce(logits_max, axis, op="max", site="vocab_parallel_cross_entropy.forward:max",
                        **where)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        if not fused:
            comm.all_reduce(target_logit, axis,
                            site="vocab_parallel_cross_entropy.forward:target_logit", **where)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        if fused:  # one all-reduce of both, concatenated along the first dimension
            both = torch.cat((target_logit, sum_exp))
            comm.all_reduce(both, axis,
                            site="vocab_parallel_cross_entropy.forward:target_logit_sum_exp",
                            **where)
            target_logit, sum_exp = both.split(target_logit.shape[0])
        else:
            comm.all_reduce(sum_exp, axis, site="vocab_parallel_cross_entropy.forward:sum_exp",
                            **where)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            sum_logits = shifted[..., :real].sum(-1)
            comm.all_reduce(sum_logits, axis,
                            site="vocab_parallel_cross_entropy.forward:sum_logits", **where)
            loss = ((1.0 - label_smoothing) * loss
                    + label_smoothing * (log_sum_exp - sum_logits / vocab))

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.label_smoothing, ctx.vocab, ctx.real, ctx.fused = label_smoothing, vocab, real, fused
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reused in place: it is not needed again
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - eps) * inside.unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.real].sub_(eps / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1))
        if ctx.fused:  # Megatron's fused backward returns bf16 (autograd casts it back)
            grad = grad.to(torch.bfloat16)
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 axis: Axis | None = None, label_smoothing: float = 0.0,
                                 module: str | None = "output",
                                 vocab_size: int | None = None, fused: bool = False
                                 ) -> torch.Tensor:
    """Per-token loss ``[..]`` from logits ``[.., V/tp]`` split over ``axis`` (the tp axis).

    Equals ``F.cross_entropy(full_logits[..., :vocab_size], target, reduction="none",
    label_smoothing=...)``; computed in fp32 whatever the logits' dtype. ``vocab_size`` is the
    real vocabulary when the logits include padding columns (a vocabulary padded to divide by
    tp): those are excluded from the softmax and the label-smoothing mean (default: none).
    ``fused``: Megatron's fused cross entropy (the module docstring).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if fused and label_smoothing:
        raise ValueError("Megatron's fused cross entropy has no label smoothing: give "
                         "label_smoothing 0 or fused False")
    if axis is None:
        axis = get_mesh().tp
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, axis,
                                            float(label_smoothing), module, vocab_size,
                                            bool(fused))
