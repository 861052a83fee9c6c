"""bf16 training: the 3D layouts of the fp32 equivalence tests agree with one bf16 process.

The tolerance, derived (u = 2**-8, the unit roundoff of bfloat16: 8 significant bits, round to
nearest, so one rounding moves a value by at most u relative):

* Parameters are bf16 copies of fp32 master weights, gradients accumulate in fp32 ``main_grad``
  buffers, and the dp reduction, the grad norm and AdamW run in fp32. So every layout starts from
  the same bf16 weights and the only differences come from the bf16 compute: where a layout
  splits a GEMM's reduction dimension (row-parallel / tensor-parallel partial sums, each rounded to
  bf16 and then reduced, sequence-parallel reduce-scatters) or reorders a sum, the result is
  rounded at a different place. Per element that is at most about 2u relative (the split partial
  sums' rounding plus the rounding of their sum).
* The gradient norm is the fp32 root-sum-of-squares of ~10^5 gradient elements, each within ~2u of
  the single-process value: even if every error had the same sign the norm moves by <= 2u, so
  ``GRAD_NORM_RTOL = 2u = 2**-7`` (7.8e-3).
* The loss is the fp32 mean of ``global_batch * seq_len = 128`` per-token cross-entropies of bf16
  logits; a token's cross-entropy moves by at most twice its largest logit change (<= 2u
  relative), and independent rounding errors over 128 tokens shrink by ~sqrt(128) ~ 11, so
  ``LOSS_RTOL = u / 4`` (9.8e-4, ~2.2x the 2u/sqrt(128) estimate).
* Steps do not compound it: AdamW moves a weight by ~lr * m / sqrt(v), and a 2u relative change
  of the gradient changes that by ~2u * lr ~ 2e-5, below the half-ulp (~4e-5 for |w| ~ 0.02) of
  the bf16 copy, so most weights round to the same bf16 value and the rest differ by one ulp,
  which is again a ~u perturbation of the next step. The same tolerance holds at every step.

Measured with this module's config (3 steps, micro-batch 2): max loss deviation 1.1e-4 and max
grad-norm deviation 1.1e-3 (both tp4-sp), 9x and 7x inside the tolerances; dp4 is bitwise equal
(its reduction is fp32). With the fp32 tests' config (5 steps, micro-batch 1, all seven layouts):
1.2e-4 and 2.1e-3 (tp4-sp). For scale, the single bf16 run deviates from the single fp32 run by up
to 1.6e-4 (loss) and 3.8e-3 (grad norm); a parallelism bug (a missing or doubled reduction, a
wrong scale) moves both by >> 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from test_training import train

U = 2.0 ** -8
"""Unit roundoff of bfloat16."""
LOSS_RTOL = U / 4
GRAD_NORM_RTOL = 2 * U
KW = dict(dtype="bf16", steps=3, micro_batch_size=2)
"""Three steps: step 0 compares the same weights, steps 1-2 the updates (fewer, larger
microbatches than the fp32 tests keep the five worlds quick on two cores; same tokens per step)."""

LAYOUTS = [  # the 3D layouts of test_training.py's equivalence test
    dict(tp=2, pp=2, dp=2, sp=True, vpp=2),
    dict(tp=2, pp=1, dp=2, sp=True),
    dict(tp=1, pp=4, dp=1, vpp=2),
    dict(tp=4, pp=1, dp=1, sp=True),
    dict(tp=1, pp=1, dp=4),
    dict(tp=2, cp=2, sp=True),  # context parallelism: the K/V ring and its dK/dV sum in bf16
    # ZeRO with two optimizer instances: bf16 parameters gathered in blocks of 2, the fp32
    # gradient shards reduce-scattered in the block and all-reduced across
    dict(tp=1, pp=1, dp=4, distributed_optimizer=True, num_distributed_optimizer_instances=2),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("bf16ref"), "single", **KW)


def deviations(got: list[dict], want: list[dict], key: str) -> list[float]:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    return [abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, want, strict=True)]


@pytest.mark.parametrize("layout", LAYOUTS,
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_bf16_layout_agrees_with_one_bf16_process(tmp_path, reference, layout):
    got = train(tmp_path, "run", **layout, **KW)
    loss, norm = deviations(got, reference, "loss"), deviations(got, reference, "grad_norm")
    print(f"bf16 {layout}: max loss dev {max(loss):.2e}, max grad-norm dev {max(norm):.2e}")
    assert max(loss) <= LOSS_RTOL, (loss, got, reference)
    assert max(norm) <= GRAD_NORM_RTOL, (norm, got, reference)


def test_bf16_tolerance_can_fail(reference):
    """The tolerance separates real differences: consecutive steps of the reference run (one
    update apart) differ by far more than it, so a layout that skipped or doubled an update, or
    mis-scaled its gradients, could not pass."""
    moved = [abs(a["loss"] - b["loss"]) / b["loss"]
             for a, b in zip(reference[1:], reference[:-1], strict=True)]
    assert len(moved) == KW["steps"] - 1
    assert min(moved) > 10 * LOSS_RTOL, moved
    assert all(m.get("skipped") is None for m in reference)


def test_bf16_softmax_is_computed_in_fp32_already():
    """Why Megatron's ``--attention-softmax-in-fp32`` is accepted with no effect: the written-out
    attention's bf16 softmax (masked as causal) gives bit for bit the probabilities of the
    softmax computed in fp32 and rounded to bf16 once, which is what the flag asks for."""
    torch.manual_seed(0)
    scores = (torch.randn(2, 4, 128, 128) * 8).bfloat16()
    scores = scores.masked_fill(torch.ones(128, 128, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.equal(scores.softmax(-1), scores.float().softmax(-1).bfloat16())


def test_bf16_params_norm_of_the_distributed_optimizers_shards(tmp_path, reference):
    """``--log-params-norm`` in bf16 is the norm of the fp32 main parameters (Megatron-LM's
    ``calc_params_l2_norm``): under the distributed optimizer each rank's main shards, summed
    over dp before the model-parallel sum; one process's replicated main copies agree within
    the bf16 tolerance (the shards are the same numbers, updated from other reductions; a
    shard not summed over dp would give about 1/sqrt(2) of it)."""
    one = train(tmp_path, "one", log_params_norm=True, **KW)
    got = train(tmp_path, "zero", tp=1, pp=2, dp=2, distributed_optimizer=True,
                log_params_norm=True, **KW)
    for a, b in zip(got, one, strict=True):
        assert a["params_norm"] == pytest.approx(b["params_norm"], rel=LOSS_RTOL), (a, b)
    assert [m["loss"] for m in one] == [m["loss"] for m in reference]  # logging changes nothing
