"""Model and hardware FLOPs of a :class:`~paraloom.analysis.spec.CommConfig`, for every
architecture the model builds: GPT-2, the Llama family and mixture of experts.

Per layer forward, on ``N = B s`` tokens (``d = h/a``, ``g`` key/value heads, ``f`` the MLP
width):

* attention: QKV ``2 N h (a + 2g) d`` (grouped-query attention: smaller K/V projections), proj
  ``2 N h^2``, QK^T and attention x V ``4 N s h`` (``a`` query heads: GQA repeats K/V);
* dense MLP: fc1 ``2 N h f`` (SwiGLU: ``2 N h 2f``, gate and up), fc2 ``2 N f h``;
* MoE layer instead: the router ``2 N h E`` plus, for each of the ``k`` experts a token is sent
  to (dropless), a GeLU MLP ``4 N h f``: ``2 N h E + 4 k N h f``;
* the logits ``2 N h V`` once (tied or untied, the GEMM is the same).

Backward is twice the forward (dgrad + wgrad). Model FLOPs (what MFU divides) count no
recomputation; hardware FLOPs (HFU) add it: ``full`` re-runs every layer's forward; ``selective``
re-runs the core attention, QK^T and attention x V (Megatron's checkpoint and paraloom's, which
runs torch's without its early stop; with ``early_stop``, a checkpoint that stops once every
saved tensor is back, paraloom's written-out attention re-runs QK^T only). Biases, norms, rotary
and softmax are element-wise and not counted (as ``torch.utils.flop_counter`` does not). For
GPT-2 these equal Narayanan et al.'s closed forms and their recompute variants
(``tests/_flops_closed_form.py``).
"""

from __future__ import annotations

__all__ = ["global_batch", "layer_forward_flops", "model_flops", "recompute_flops",
           "hardware_flops"]


def global_batch(c) -> int:
    """Samples per step: ``b m dp`` (cp splits each sequence, not the batch)."""
    return c.micro_batch * c.num_microbatches * c.dp


def _is_moe(c, index: int) -> bool:
    return c.moe is not None and c.moe.is_moe_layer(index)


def _layers_forward(c, batch: int | None) -> float:
    """Forward FLOPs of all layers (one dense and one MoE layer, times how many of each)."""
    n_moe = sum(1 for i in range(c.layers) if c.moe.is_moe_layer(i)) if c.moe else 0
    dense = sum(layer_forward_flops(c, -1, batch).values()) if n_moe < c.layers else 0
    moe = sum(layer_forward_flops(c, 0, batch).values()) if n_moe else 0
    return (c.layers - n_moe) * dense + n_moe * moe


def layer_forward_flops(c, index: int = 0, batch: int | None = None) -> dict:
    """Forward FLOPs of layer ``index`` (``-1``: a dense one) on ``batch`` samples (default
    the global batch), by part: ``linear`` (QKV, proj), ``attention`` (QK^T, attention x V),
    ``mlp`` (dense MLP, or the router and the experts of a MoE layer)."""
    h, a, s, f = c.hidden, c.heads, c.seq_len, c.f
    n = (global_batch(c) if batch is None else batch) * s
    g = c.arch.num_query_groups or a
    linear = 2 * n * h * (a + 2 * g) * (h // a) + 2 * n * h * h
    attention = 4 * n * s * h
    if index >= 0 and _is_moe(c, index):
        # the router, each routed token through one expert's MLP, and a shared expert on every
        # token (plus its gate's 2 n h)
        mlp = 2 * n * h * c.moe.num_experts + c.moe.topk * c.arch.mlp_flops(n, h, f)
        if c.moe.shared_ffn:
            mlp += c.arch.mlp_flops(n, h, c.moe.shared_ffn) + \
                (2 * n * h if c.moe.shared_gate else 0)
    else:
        mlp = c.arch.mlp_flops(n, h, f)
    return {"linear": linear, "attention": attention, "mlp": mlp}


def model_flops(c, batch: int | None = None) -> float:
    """FLOPs the model needs per step (no recomputation): 3 x (layers' forward + logits)."""
    n = (global_batch(c) if batch is None else batch) * c.seq_len
    return 3 * (_layers_forward(c, batch) + 2 * n * c.hidden * c.vocab)


def recompute_flops(c, batch: int | None = None, *, early_stop: bool = False) -> float:
    """FLOPs recomputation (``c.recompute``) adds per step."""
    if c.recompute == "full":
        return _layers_forward(c, batch)
    if c.recompute == "selective":
        attn = layer_forward_flops(c, 0, batch)["attention"] * c.layers
        return attn / 2 if early_stop and c.arch.attention == "core" else attn
    return 0.0


def hardware_flops(c, batch: int | None = None, *, early_stop: bool = False) -> float:
    """FLOPs the GPUs execute per step: model FLOPs plus the configured recomputation."""
    return model_flops(c, batch) + recompute_flops(c, batch, early_stop=early_stop)
