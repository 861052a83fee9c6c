"""Mixture of experts: the ep/edp grid, routing, the MoE layer under ep/tp/sp against a plain loop
over experts (outputs and every gradient), and training under five layouts with ep in {2, 4}
against one process (LM loss, aux and z loss, gradient norm, tokens per expert, dropped tokens),
all in one warm 4-rank world."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paraloom.config import ModelConfig, ParallelConfig, TrainConfig, check_layout
from paraloom.mesh import Axis, expert_rank_groups, rank_groups
from paraloom.moe import expert_capacity, topk_routing

CFG = ModelConfig(hidden_size=16, num_attention_heads=2, seq_length=8, num_experts=4,
                  moe_router_topk=2, ffn_hidden_size=24, moe_z_loss_coeff=1e-3)


# ------------------------------------------------------------------ pure logic
def test_expert_groups_are_carved_out_of_data_parallel():
    g = expert_rank_groups(tp=2, pp=1, dp=4, ep=2)
    assert g["ep"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g["edp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    dp = rank_groups(2, 1, 4)["dp"]
    for group in g["ep"] + g["edp"]:  # every ep/edp group lies inside one dp group
        assert any(set(group) <= set(d) for d in dp)
    assert expert_rank_groups(1, 2, 2, ep=1)["edp"] == rank_groups(1, 2, 2)["dp"]
    # with context parallelism (cp fastest after tp), ep blocks run over dp x cp
    assert expert_rank_groups(tp=1, pp=1, dp=2, ep=4, cp=2)["ep"] == [(0, 1, 2, 3)]
    with pytest.raises(ValueError, match=r"ep = 3 must divide dp \* cp = 4 \* 1 = 4"):
        expert_rank_groups(1, 1, 4, ep=3)


def test_bad_moe_settings_name_the_values():
    with pytest.raises(ValueError, match="moe_router_topk = 5 is larger than num_experts = 4"):
        ModelConfig(num_experts=4, moe_router_topk=5)
    with pytest.raises(ValueError, match="ep = 3 does not divide dp \\* cp = 4"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(ValueError, match="num_experts = 6 is not divisible by ep = 4"):
        check_layout(ModelConfig(num_experts=6), ParallelConfig(dp=4, ep=4))


def test_run_folders_from_before_the_allgather_dispatcher_read_as_alltoall():
    """A ``config.json`` written when alltoall was paraloom's only dispatcher keeps it on
    ``--resume`` and in ``check``; a new MoE config gets Megatron's default, allgather."""
    saved = TrainConfig().replace(model=ModelConfig(num_experts=4)).to_dict()
    assert TrainConfig.from_dict(saved).model.moe_token_dispatcher_type == "allgather"
    del saved["model"]["moe_token_dispatcher_type"]
    assert TrainConfig.from_dict(saved).model.moe_token_dispatcher_type == "alltoall"


def test_capacity_drops_are_deterministic():
    logits = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    cap = expert_capacity(32, 2, 4, 0.5)
    assert cap == 8
    for policy in ("probs", "position"):
        probs, keep, before = topk_routing(logits, 2, 0.5, policy)
        assert int(before.sum()) == 64 and (keep.sum(0) <= cap).all()
        assert torch.equal(probs != 0, keep)
        again = topk_routing(logits.clone(), 2, 0.5, policy)[1]
        assert torch.equal(keep, again)
    # position: each expert keeps its earliest tokens
    _, keep, _ = topk_routing(logits, 2, 0.5, "position")
    full = topk_routing(logits, 2)[1]
    for e in range(4):
        rows = full[:, e].nonzero().flatten()
        assert torch.equal(keep[:, e].nonzero().flatten(), rows[:cap])


# ------------------------------------------------------------------ the layer, multi-rank
def _solo(rank):
    one = lambda n: Axis(n, (rank,), 0)  # noqa: E731
    return SimpleNamespace(tp=one("tp"), ep=one("ep"), dp=one("dp"))


def _data(d, sp_len, b=2):
    g = torch.Generator().manual_seed(100 + d)
    return torch.randn(sp_len, b, CFG.hidden_size, generator=g), \
        torch.randn(sp_len, b, CFG.hidden_size, generator=g)


def _reference(layer, x, proj, cfg):
    """A plain loop over all experts for one microbatch; returns (y, loss)."""
    s, b, h = x.shape
    tokens = x.reshape(-1, h)
    logits = tokens @ layer.router.weight.t()
    if layer.router.bias is not None:  # Megatron's router bias under add_bias_linear
        logits = logits + layer.router.bias
    n, e, k = tokens.shape[0], cfg.num_experts, cfg.moe_router_topk
    top, idx = torch.topk(logits, k, -1)
    w = torch.softmax(top, -1)
    chosen = torch.zeros(n, e, dtype=torch.bool).scatter(1, idx, True)
    weight = torch.zeros(n, e).scatter(1, idx, w)
    if cfg.moe_expert_capacity_factor is not None:
        chosen = topk_routing(logits.detach(), k, cfg.moe_expert_capacity_factor,
                              cfg.moe_token_drop_policy)[1]
        weight = weight * chosen
    y = torch.zeros_like(tokens)
    for g in range(e):
        ex = layer.experts[str(g)]
        rows = chosen[:, g].nonzero().flatten()
        if cfg.swiglu:  # fc1 = [gate; up], no biases
            gate, up = (tokens[rows] @ ex.fc1.weight.t()).chunk(2, -1)
            out = (F.silu(gate) * up) @ ex.fc2.weight.t()
        else:
            hmid = F.gelu(tokens[rows] @ ex.fc1.weight.t() + ex.fc1.bias, approximate="tanh")
            out = hmid @ ex.fc2.weight.t() + ex.fc2.bias
        y = y.index_add(0, rows, out * weight[rows, g:g + 1])
    p = torch.softmax(logits, -1)
    before = torch.zeros(n, e).scatter(1, idx, 1.0).sum(0)
    aux = cfg.moe_aux_loss_coeff * e / (n * n * k) * (p.sum(0) * before).sum()
    z = cfg.moe_z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    y = y.view(s, b, h)
    return y, (y * proj).sum() + aux + z


def layer_vs_loop(tp, ep, sp, capacity, swiglu=False, dispatcher="alltoall"):
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import ParallelOptions
    from paraloom.moe import MoELayer
    from paraloom.tensor_parallel.init import CounterInit
    from paraloom.utils import divide

    torch.manual_seed(0)
    cfg = ModelConfig(**{**CFG.__dict__, "moe_expert_capacity_factor": capacity,
                         "swiglu": swiglu, "add_bias_linear": not swiglu,
                         "moe_token_dispatcher_type": dispatcher})
    world = dist.get_world_size()
    mesh = ParallelMesh(tp=tp, dp=world // tp, ep=ep)
    opt = ParallelOptions(sequence_parallel=sp)
    init, out_init = CounterInit(7, 0.2), CounterInit(7, 0.1)
    layer = MoELayer(cfg, mesh, "layers.0.mlp", opt, init, out_init).train()
    ref = MoELayer(cfg, _solo(dist.get_rank()), "layers.0.mlp", ParallelOptions(), init,
                   out_init).train()
    d = mesh.dp.rank
    x_full, proj_full = _data(d, cfg.seq_length)
    lo, hi = (0, cfg.seq_length)
    if sp and tp > 1:
        per = divide(cfg.seq_length, tp)
        lo, hi = mesh.tp.rank * per, (mesh.tp.rank + 1) * per
    x = x_full[lo:hi].clone().requires_grad_()
    y = layer(x)
    (y * proj_full[lo:hi]).sum().backward()
    # reference: own microbatch for the output and x grad; every ep peer's for expert grads
    xr = x_full.clone().requires_grad_()
    yr, loss = _reference(ref, xr, proj_full, cfg)
    loss.backward(inputs=[xr])
    torch.testing.assert_close(y, yr[lo:hi], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad[lo:hi], rtol=1e-5, atol=1e-6)
    ref.zero_grad()
    peers = [mesh.dp.ranks.index(r) for r in mesh.ep.ranks]
    for peer in peers:
        xp, pp_ = _data(peer, cfg.seq_length)
        _reference(ref, xp, pp_, cfg)[1].backward()
    router_grad = ref.router.weight.grad.clone()
    ref.router.weight.grad = None
    _reference(ref, x_full, proj_full, cfg)[1].backward(inputs=[ref.router.weight])
    g = layer.router.weight.grad
    if sp and tp > 1:  # partial over the sequence slices: finalize_model_grads sums it over tp
        dist.all_reduce(g, group=mesh.tp.group)
    torch.testing.assert_close(g, ref.router.weight.grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(router_grad, ref.router.weight.grad)  # peers' data differs
    for gid in layer.local_ids:
        mine, theirs = layer.experts[str(gid)], ref.experts[str(gid)]
        f = divide(cfg.ffn, tp)
        r = slice(mesh.tp.rank * f, (mesh.tp.rank + 1) * f)
        rows = theirs.fc1.weight.grad[r]
        if swiglu:  # this rank's gate rows, then its up rows (partition_stride 2)
            assert mine.fc1.weight.shape == (2 * f, cfg.hidden_size) and mine.fc1.bias is None
            rows = torch.cat([rows, theirs.fc1.weight.grad[cfg.ffn:][r]])
        torch.testing.assert_close(mine.fc1.weight.grad, rows, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine.fc2.weight.grad, theirs.fc2.weight.grad[:, r], rtol=1e-5,
                                   atol=1e-6)
        if swiglu:
            continue
        b2 = mine.fc2.bias.grad
        if tp > 1:
            dist.all_reduce(b2, group=mesh.tp.group)
        torch.testing.assert_close(b2, theirs.fc2.bias.grad, rtol=1e-5, atol=1e-6)
    return {"kept": int(layer.stats["tokens_per_expert"].sum()),
            "dropped": int(layer.stats["dropped"]), "local": list(layer.local_ids)}


@pytest.mark.parametrize("tp,ep,sp,capacity,swiglu,dispatcher", [
    (1, 2, False, None, False, "alltoall"), (1, 4, False, None, False, "alltoall"),
    (2, 2, True, None, False, "alltoall"), (2, 2, False, None, False, "alltoall"),
    (1, 2, False, 0.5, False, "alltoall"), (2, 2, True, 0.75, False, "alltoall"),
    # SwiGLU experts without biases (Mixtral's): gate and up rows split over tp with stride 2
    (2, 2, True, None, True, "alltoall"), (1, 4, False, None, True, "alltoall"),
    # Megatron's default dispatcher: tokens gathered over tp x ep (own tokens) or ep
    (1, 4, False, None, False, "allgather"), (2, 2, True, None, False, "allgather"),
    (2, 2, False, None, False, "allgather"), (2, 2, True, 0.75, False, "allgather"),
    (2, 2, True, None, True, "allgather")])
def test_moe_layer_equals_a_plain_loop_over_experts(world4, tp, ep, sp, capacity, swiglu,
                                                    dispatcher):
    res = world4.run(layer_vs_loop, tp, ep, sp, capacity, swiglu, dispatcher)
    n = CFG.seq_length * 2 * CFG.moe_router_topk
    # each microbatch's assignments counted once: by tp rank 0 where every tp rank routes the
    # whole microbatch, by every tp rank for its own slice where sp splits it (dropless)
    assert sum(r["kept"] + r["dropped"] for r in res) == n * (4 // tp)
    split = sp and tp > 1 and capacity is None
    assert all((r["kept"] > 0) == (split or i % tp == 0) for i, r in enumerate(res))
    assert (sum(r["dropped"] for r in res) > 0) == (capacity is not None)
    assert sorted({g for r in res for g in r["local"]}) == list(range(CFG.num_experts))
    assert math.isfinite(res[0]["kept"])


# ------------------------------------------------------------------ training, every layout
TRAIN_MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_layers=4, num_attention_heads=4,
                          seq_length=16, num_experts=4, moe_router_topk=2, moe_layer_freq=2,
                          moe_z_loss_coeff=1e-3)
TRAIN = TrainConfig().replace(parallel=ParallelConfig(), model=TRAIN_MODEL,
                              global_batch_size=4, micro_batch_size=1, steps=4,
                    lr=3e-3, warmup_steps=1, save_every=0)


def train_steps(cfg):
    """The training loop's steps without its files: ``train_step`` metrics for ``cfg.steps``."""
    from paraloom.data import Corpus, load_corpus
    from paraloom.mesh import ParallelMesh
    from paraloom.training.train import build, train_step
    mesh = ParallelMesh(cfg.parallel)
    run = build(cfg, mesh, Corpus(load_corpus(cfg.data.file), cfg.model.seq_length, cfg.seed))
    return [train_step(run, s) for s in range(cfg.steps)]


def _cfg(model=TRAIN_MODEL, *, tp=1, pp=1, dp=1, ep=1, sp=False, zero=False, cp=1):
    return TRAIN.replace(model=model, parallel=ParallelConfig(
        tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, sequence_parallel=sp), distributed_optimizer=zero,
        schedule="1f1b" if pp > 1 else "none")


def assert_same_training(got, want, rtol=1e-5, loss=True):
    """LM loss (``loss``: this rank holds it, the last pipeline stage), aux and z loss, gradient
    norm at ``rtol``; tokens per expert and drops exactly."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a["loss"] is not None) == loss, a
        for key in ("loss", "aux_loss", "z_loss", "grad_norm")[0 if loss else 1:]:
            assert a[key] == pytest.approx(b[key], rel=rtol), (key, a, b)
        assert a["tokens_per_expert"] == b["tokens_per_expert"]
        assert a.get("dropped_tokens") == b.get("dropped_tokens")


# Mixtral's shape: SwiGLU experts without biases, RMSNorm, rotary positions, grouped-query
# attention, untied output layer
MIXTRAL_MODEL = replace(TRAIN_MODEL, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
                        position_embedding_type="rope", num_query_groups=2,
                        untie_embeddings_and_output_weights=True)


# DeepSeek's / Qwen-MoE's shape: a gated shared expert every token runs beside the routed ones
SHARED_MODEL = replace(MIXTRAL_MODEL, moe_shared_expert_intermediate_size=48,
                       moe_shared_expert_gate=True)


@pytest.fixture(scope="module")
def single():
    """One process (the pytest process itself, no torch.distributed): the oracle."""
    out = {cf: train_steps(_cfg(replace(TRAIN_MODEL, moe_expert_capacity_factor=cf)))
           for cf in (None, 1.0)}
    out["mixtral"] = train_steps(_cfg(MIXTRAL_MODEL))
    out["shared"] = train_steps(_cfg(SHARED_MODEL))
    return out


@pytest.mark.parametrize("layout", [
    dict(dp=4, ep=4), dict(dp=4, ep=2, zero=True), dict(tp=2, dp=2, ep=2, sp=True),
    dict(tp=2, dp=2, ep=2, zero=True), dict(pp=2, dp=2, ep=2),
    # context parallelism: router counts summed over cp, ep carved out of dp x cp
    dict(cp=2, dp=2, ep=4, zero=True), dict(tp=2, cp=2, ep=2, sp=True),
    dict(cp=2, dp=2, ep=2),
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_expert_layout_trains_the_same_model(world4, single, layout):
    got = world4.run(train_steps, _cfg(**layout))
    pp = layout.get("pp", 1)
    for rank, rank_metrics in enumerate(got):  # every rank reports the same numbers (the loss:
        assert_same_training(rank_metrics, single[None], loss=rank >= 4 - 4 // pp)  # last stage)
    first = got[-1][0]
    assert first["aux_loss"] > 0 and got[-1][-1]["loss"] < first["loss"]
    assert set(first["tokens_per_expert"]) == {"0", "2"}  # moe_layer_freq 2
    assert all(sum(v) == 4 * 16 * 2 for v in first["tokens_per_expert"].values())


@pytest.mark.parametrize("layout", [
    dict(dp=4, ep=4), dict(tp=2, dp=2, ep=2, sp=True), dict(pp=2, dp=2, ep=2, zero=True),
    dict(tp=2, cp=2, ep=2, sp=True),
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_per_token_loss_with_experts_trains_the_same_model(world4, single, layout):
    """``--calculate-per-token-loss`` with MoE: Megatron multiplies the auxiliary and z losses
    by the router's tokens x tp x cp (the microbatch's tokens), so that after the division by
    the step's tokens their gradients are scaled as without the flag: the same model."""
    got = world4.run(train_steps, TRAIN.replace(calculate_per_token_loss=True).replace(
        **{k: v for k, v in vars(_cfg(**layout)).items() if k in ("parallel", "schedule",
                                                                   "distributed_optimizer")}))
    pp = layout.get("pp", 1)
    for rank, rank_metrics in enumerate(got):
        assert_same_training(rank_metrics, single[None], loss=rank >= 4 - 4 // pp)


@pytest.mark.parametrize("layout", [
    dict(dp=4, ep=4), dict(tp=2, dp=2, ep=2, sp=True), dict(tp=2, dp=2, ep=2, zero=True),
    dict(pp=2, dp=2, ep=2), dict(tp=2, cp=2, ep=2, sp=True), dict(cp=2, dp=2, ep=4, zero=True),
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_the_alltoall_dispatcher_trains_the_same_model(world4, single, layout):
    """``--moe-token-dispatcher-type alltoall`` (the default is Megatron's allgather): tokens
    and probabilities all-to-all'd over ep, gathered over tp under sp; the same model."""
    model = replace(TRAIN_MODEL, moe_token_dispatcher_type="alltoall")
    got = world4.run(train_steps, _cfg(model, **layout))
    pp = layout.get("pp", 1)
    for rank, rank_metrics in enumerate(got):
        assert_same_training(rank_metrics, single[None], loss=rank >= 4 - 4 // pp)


@pytest.mark.parametrize("layout", [
    dict(dp=4, ep=4, zero=True), dict(tp=2, dp=2, ep=2, sp=True), dict(pp=2, dp=2, ep=2),
    dict(tp=2, cp=2, ep=2, sp=True)], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_swiglu_experts_without_biases_train_the_same_model(world4, single, layout):
    """Mixtral-style experts (SwiGLU, no biases; ``[gate_r; up_r]`` fc1 rows on tp rank r) in a
    Llama-family model: every layout trains what one process trains."""
    got = world4.run(train_steps, _cfg(MIXTRAL_MODEL, **layout))
    pp = layout.get("pp", 1)
    for rank, rank_metrics in enumerate(got):
        assert_same_training(rank_metrics, single["mixtral"], loss=rank >= 4 - 4 // pp)
    assert single["mixtral"][0]["loss"] != pytest.approx(single[None][0]["loss"], rel=1e-3)


@pytest.mark.parametrize("layout", [
    dict(dp=4, ep=2, zero=True), dict(tp=2, dp=2, ep=2, sp=True), dict(pp=2, dp=2, ep=2)],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_grouped_gemm_experts_train_the_same_model(world4, single, layout):
    """``--moe-grouped-gemm`` (Megatron's TEGroupedMLP parameter order: fc1 of every local
    expert, then fc2, in the gradient buffer and the distributed optimizer's shards): the model
    one process trains without it."""
    got = world4.run(train_steps, _cfg(replace(MIXTRAL_MODEL, moe_grouped_gemm=True), **layout))
    pp = layout.get("pp", 1)
    for rank, rank_metrics in enumerate(got):
        assert_same_training(rank_metrics, single["mixtral"], loss=rank >= 4 - 4 // pp)


@pytest.mark.parametrize("layout", [
    dict(tp=2, dp=2, ep=2, sp=True), dict(tp=2, dp=2, ep=2, zero=True), dict(pp=2, dp=2, ep=2),
    dict(dp=4, ep=4, zero=True), dict(tp=2, cp=2, ep=2, sp=True)],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_shared_expert_with_gate_trains_the_same_model(world4, single, layout):
    """``--moe-shared-expert-intermediate-size`` with ``--moe-shared-expert-gate``: the shared
    expert (a tp-split MLP every token runs, its gate replicated and summed over tp under sp)
    gives every layout what one process trains."""
    got = world4.run(train_steps, _cfg(SHARED_MODEL, **layout))
    pp = layout.get("pp", 1)
    for rank, rank_metrics in enumerate(got):
        assert_same_training(rank_metrics, single["shared"], loss=rank >= 4 - 4 // pp)
    shared, routed = single["shared"][0]["grad_norm"], single["mixtral"][0]["grad_norm"]
    assert shared != pytest.approx(routed, rel=1e-4)  # the shared expert is in the model


@pytest.mark.parametrize("layout", [dict(tp=2, dp=2, ep=2, sp=True), dict(dp=4, ep=4),
                                    dict(tp=2, cp=2, ep=2, sp=True), dict(cp=2, dp=2, ep=4)],
                         ids=["tp2-sp-ep2", "dp4-ep4", "tp2-sp-cp2-ep2", "cp2-dp2-ep4"])
def test_capacity_factor_drops_the_same_tokens_in_every_layout(world4, single, layout):
    want = single[1.0]
    assert all(m["dropped_tokens"] > 0 for m in want)
    model = replace(TRAIN_MODEL, moe_expert_capacity_factor=1.0)
    assert_same_training(world4.run(train_steps, _cfg(model, **layout))[-1], want)
    assert all(sum(v) < 4 * 16 * 2 for v in want[0]["tokens_per_expert"].values())


@pytest.mark.parametrize("layout", [dict(dp=4, ep=4), dict(tp=2, cp=2, ep=2, sp=True)],
                         ids=["dp4-ep4", "tp2-sp-cp2-ep2"])
def test_padding_to_capacity_changes_no_result(world4, single, layout):
    """``moe_pad_expert_input_to_capacity``: padded rows have weight 0, so the run equals the
    unpadded one-process run with the same capacity factor."""
    model = replace(TRAIN_MODEL, moe_expert_capacity_factor=1.0,
                    moe_pad_expert_input_to_capacity=True, moe_token_dispatcher_type="alltoall")
    assert_same_training(world4.run(train_steps, _cfg(model, **layout))[-1], single[1.0])


def test_plan_and_layout_count_the_real_experts():
    from paraloom.analysis.formulas import CommConfig
    from paraloom.analysis.layout import chunk_params
    from paraloom.analysis.moe_formulas import MoECommConfig
    from paraloom.analysis.plan import plan
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import GPTModel

    model = GPTModel(TRAIN_MODEL, ParallelMesh())
    real = {n: p.numel() for n, p in model.named_parameters()}
    moe = MoECommConfig(num_experts=4, topk=2, ep=1, layer_freq=2)
    c = CommConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=256, moe=moe)
    assert plan(c)["parameters"]["total"] == plan(c)["parameters"]["per_gpu"] == sum(real.values())
    assert {p.name: p.numel for p in chunk_params(c, 0)} == real  # names and sizes, in order
    assert [p.name for p in chunk_params(c, 0)] == list(real)
    # ep = 2 over dp = 2: each rank holds half of every MoE layer's experts
    c2 = replace(c, dp=2, moe=replace(moe, ep=2))
    experts = sum(n for name, n in real.items() if ".experts." in name)
    assert plan(c2)["parameters"]["per_gpu"] == sum(real.values()) - experts // 2
    # Mixtral's shape: SwiGLU experts (fc1 2f rows) without biases, in a Llama-family model
    from paraloom.analysis.spec import Architecture
    mixtral = GPTModel(MIXTRAL_MODEL, ParallelMesh())
    real = {n: p.numel() for n, p in mixtral.named_parameters()}
    arch = Architecture(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                        position_embedding_type="rope", num_query_groups=2,
                        untie_embeddings_and_output_weights=True)
    c3 = replace(c, arch=arch, ffn=MIXTRAL_MODEL.ffn)
    assert [(p.name, p.numel) for p in chunk_params(c3, 0)] == list(real.items())
    assert plan(c3)["parameters"]["total"] == sum(real.values())
    assert real["layers.0.mlp.experts.0.fc1.weight"] == 2 * real["layers.1.mlp.fc2.weight"]
    experts = sum(n for name, n in real.items() if ".experts." in name)
    c4 = replace(c3, dp=2, moe=replace(moe, ep=2))
    assert plan(c4)["parameters"]["per_gpu"] == sum(real.values()) - experts // 2
    # a gated shared expert, tp = 2: its gate replicated, fc1/fc2 split
    shared = GPTModel(SHARED_MODEL, ParallelMesh())
    real = {n: p.numel() for n, p in shared.named_parameters()}
    c5 = replace(c3, moe=replace(moe, shared_ffn=48, shared_gate=True))
    assert [(p.name, p.numel) for p in chunk_params(c5, 0)] == list(real.items())
    assert plan(c5)["parameters"]["total"] == plan(c5)["parameters"]["per_gpu"] == \
        sum(real.values())
    c6 = replace(c5, tp=2, sequence_parallel=True)  # the layout's list and plan's count agree
    assert plan(c6)["parameters"]["per_gpu"] == sum(p.numel for p in chunk_params(c6, 0))
    assert plan(c6)["parameters"]["per_gpu"] < sum(real.values())


def empty_all_to_all():
    from paraloom import comm
    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    mesh = ParallelMesh(dp=dist.get_world_size(), ep=4)
    r = mesh.ep.rank
    ins = [0, 0, 0, 0] if r == 0 else [1, 1, 1, 1]  # rank 0 sends nothing
    outs = [0, 1, 1, 1]
    x = torch.full((sum(ins), 3), float(r))
    with recording(Ledger(rank=dist.get_rank())) as led:
        y = comm.all_to_all(x, mesh.ep, input_splits=ins, output_splits=outs, phase="forward",
                            kind="ep", site="test")
    e = led.events[0]
    return y[:, 0].tolist(), e["bytes"], e["recv_bytes"], e["row_bytes"]


def aux_counts_sites(coeff):
    from paraloom.ledger import Ledger, recording
    from paraloom.mesh import ParallelMesh
    from paraloom.models.gpt import ParallelOptions
    from paraloom.moe import MoELayer
    from paraloom.tensor_parallel.init import CounterInit

    cfg = replace(CFG, moe_aux_loss_coeff=coeff, moe_z_loss_coeff=None)
    mesh = ParallelMesh(tp=2, dp=2, ep=2)
    layer = MoELayer(cfg, mesh, "layers.0.mlp", ParallelOptions(sequence_parallel=True),
                     CounterInit(7, 0.2), CounterInit(7, 0.1)).train()
    with recording(Ledger(rank=dist.get_rank())) as led:
        layer(torch.randn(cfg.seq_length // 2, 2, cfg.hidden_size)).sum().backward()
    return [(e["site"], e["kind"], e["op"]) for e in led.events
            if e["site"].startswith("MoELayer.")]


def test_no_aux_loss_no_counts_all_reduce(world4):
    """``--moe-aux-loss-coeff 0`` (Megatron-LM's default): no load-balancing loss, so the
    router's counts are not summed over tp x cp (Megatron returns before counting)."""
    for coeff, want in ((0.0, []), (1e-2, [("MoELayer.router:tokens_per_expert", "sp",
                                             "all_reduce")])):
        assert all(sites == want for sites in world4.run(aux_counts_sites, coeff)), coeff


def test_a_megatron_lm_command_line_gets_no_aux_loss():
    from paraloom.commands.megatron_lm_flags import megatron_lm_spellings
    from paraloom.commands.train import parser
    from paraloom.commands.train_flags import config_from_args

    def model(*flags):  # as ``paraloom train FLAGS`` reads them (main marks the spellings)
        args = parser().parse_args(list(flags))
        args.megatron_lm_spelt = megatron_lm_spellings(parser(), list(flags))
        return config_from_args(args)[0].model

    lm = ("--tensor-model-parallel-size", "1", "--num-layers", "2", "--num-experts", "4")
    assert model(*lm).moe_aux_loss_coeff == 0.0
    assert model(*lm, "--moe-aux-loss-coeff", "0.02").moe_aux_loss_coeff == 0.02
    assert model("--num-experts", "4").moe_aux_loss_coeff == 1e-2  # paraloom's own default
    assert model("--tensor-model-parallel-size", "1").moe_aux_loss_coeff == 1e-2  # dense


def test_all_to_all_with_an_empty_send(world4):
    for r, (got, sent, received, row) in enumerate(world4.run(empty_all_to_all)):
        assert got == [1.0, 2.0, 3.0] and row == 12 and received == 36
        assert sent == (0 if r == 0 else 48)


def test_plan_times_the_shared_experts_tp_traffic():
    """A MoE layer's tensor-parallel regions: the attention's; the dense MLP's only where every
    tp rank routes the whole microbatch (a capacity factor), not where tp ranks dispatch their
    own tokens (dropless under sp: the dispatcher's tp exchanges are timed as ep); a shared
    expert's always. Its GEMMs add compute."""
    from paraloom.analysis.costs import Options, layer_time
    from paraloom.analysis.formulas import CommConfig
    from paraloom.analysis.hardware import GPUS
    from paraloom.analysis.moe_formulas import MoECommConfig

    moe = MoECommConfig(num_experts=8, topk=2, ep=2)
    c = CommConfig(layers=8, hidden=1024, heads=16, seq_len=2048, vocab=51200, tp=4, dp=2,
                   moe=moe, sequence_parallel=True)
    hw = GPUS["a100-80gb"]
    times = {}
    for capacity in (False, True):
        for ffn in (0, 1024):
            cc = replace(c, moe=replace(moe, shared_ffn=ffn, capacity=capacity))
            times[capacity, ffn] = layer_time(cc, hw, Options(), 8, moe_layer=True)
    # the same GEMMs hide as much of each: one region of two, two of three
    assert times[False, 0]["tp_comm"] == pytest.approx(times[True, 0]["tp_comm"] / 2)
    assert times[False, 1024]["tp_comm"] == pytest.approx(times[True, 1024]["tp_comm"] * 2 / 3)
    assert times[True, 0]["tp_comm"] < times[True, 1024]["tp_comm"] \
        <= 1.5 * times[True, 0]["tp_comm"]
    assert times[False, 0]["ep_comm"] > times[True, 0]["ep_comm"]  # the tp gathers, scatters
    plain, shared = times[False, 0], times[False, 1024]
    assert shared["gemm"] > plain["gemm"]
