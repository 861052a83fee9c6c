"""Megatron-LM flags of features paraloom does not have: refused by name, before parsing.

A Megatron-LM command line (``pretrain_gpt.py``'s arguments, :mod:`.megatron_lm_flags`) that
asks for one of these would otherwise run without it and communicate differently from what
Megatron-LM does, or stop at argparse's bare "unrecognized arguments". Each entry says what the
feature changes (from Megatron-LM's code) and what paraloom has instead; ``paraloom train`` and
``paraloom plan`` exit 2 naming the first one given.
"""

from __future__ import annotations

__all__ = ["NOT_BUILT", "not_built"]

NOT_BUILT = {
    "--use-torch-fsdp2": "torch FSDP2 as Megatron's data-parallel wrapper is not built; "
                         "paraloom record shows a torch FSDP2 program's own communication",
    "--overlap-moe-expert-parallel-comm": "Megatron's MoE communication/computation overlap "
                                          "across microbatches is not built",
    "--grad-reduce-in-bf16": "gradients reduced in bf16 (half the bytes of each gradient "
                             "reduction) is not built; paraloom reduces fp32 gradients, "
                             "Megatron's default",
    "--log-timers-to-tensorboard": "Megatron's timers in TensorBoard (their times all-gathered "
                                   "over the ranks at every log) are not built; "
                                   "--tensorboard-dir writes paraloom's own metrics",
    "--apply-layernorm-1p": "Megatron's zero-centred LayerNorm weight (weights w applied as "
                            "1 + w) is not built",
    "--train-samples": "sample-based training is not built: give --train-iters (iterations "
                       "of --global-batch-size samples)",
    "--rampup-batch-size": "a global batch that grows over the first samples (deprecated in "
                           "megatron-core 0.19) is not built: every step has "
                           "--global-batch-size samples",
    "--lr-decay-samples": "sample-based schedules are not built: give --lr-decay-iters",
    "--lr-warmup-samples": "sample-based schedules are not built: give --lr-warmup-iters or "
                           "--lr-warmup-fraction",
}
"""Megatron-LM flags of features paraloom does not have, refused by name with what it has."""


def not_built(argv: list[str]) -> str | None:
    """The refusal of the first flag of :data:`NOT_BUILT` in ``argv`` (``None``: none)."""
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in NOT_BUILT:
            return f"{flag}: {NOT_BUILT[flag]}"
    return None
