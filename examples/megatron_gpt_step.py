"""Megatron-Core's own GPT training step, as Megatron-LM's training loop drives it, on CPU ranks.

It builds megatron-core's ``GPTModel`` (the local layer spec: no Transformer Engine), wraps every
model chunk in Megatron's ``DistributedDataParallel``, takes ``get_megatron_optimizer`` and
``get_forward_backward_func()`` and installs the hooks Megatron-LM's ``train()`` installs
(``no_sync_func``, ``grad_sync_func`` for ``--align-grad-reduce``, ``finalize_model_grads``); each
iteration is Megatron-LM's ``train_step``: zero the buffers, the schedule, ``optimizer.step()``
(the gradient norm and clipping inside), the update flag and the gradient norm agreed over the
model-parallel group, and on the last stage the loss summed over the data-parallel ranks.
Everything but the data reading is megatron-core's code; the data are paraloom's bundled corpus
(every rank reads its own microbatches, where Megatron-LM's ``get_batch`` broadcasts them from
tp rank 0). Run it under ``paraloom record`` with the CPU patches::

    paraloom record --megatron-on-cpu --nproc 4 --out rec -- examples/megatron_gpt_step.py \\
        --tp 2 --pp 2
    paraloom table rec --step 1

and compare it with paraloom's own step of the same model and layout::

    paraloom train --tp 2 --pp 2 --dp 1 --layers 4 --hidden 64 --heads 4 --seq-len 32 \\
        --global-batch-size 8 --micro-batch-size 2 --steps 2 --ledger-steps 2 \\
        --no-overlap-p2p-communication --out ours
    paraloom diff rec ours --step 1 --ignore-names

``--use-megatron-fsdp [--data-parallel-sharding-strategy S]`` wraps the chunks in megatron-core's
Megatron-FSDP instead (Megatron-LM's ``get_model`` under ``--use-megatron-fsdp``), whose
communication ``paraloom train`` does not build yet: record it to see it::

    paraloom record --megatron-on-cpu --nproc 2 --out fsdp -- examples/megatron_gpt_step.py \
        --use-megatron-fsdp --layers 2 --microbatches 2
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = ap.add_argument
    a("--tp", type=int, default=1)
    a("--pp", type=int, default=1)
    a("--cp", type=int, default=1)
    a("--vpp", type=int, default=None, help="virtual stages per pipeline rank (interleaved)")
    a("--sequence-parallel", action="store_true")
    a("--distributed-optimizer", action="store_true")
    a("--num-distributed-optimizer-instances", type=int, default=1,
      help="the distributed optimizer's copies over the data-parallel ranks")
    a("--overlap-param-gather", action="store_true",
      help="the distributed optimizer's parameter all-gather in the next forward (pre-hooks)")
    a("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false")
    a("--no-align-grad-reduce", dest="align_grad_reduce", action="store_false")
    a("--no-align-param-gather", dest="align_param_gather", action="store_false")
    a("--overlap-param-gather-with-optimizer-step", action="store_true")
    a("--bucket-size", type=int, default=None, help="gradient bucket size (elements)")
    a("--use-megatron-fsdp", action="store_true",
      help="Megatron-FSDP instead of DistributedDataParallel (with the distributed optimizer)")
    a("--data-parallel-sharding-strategy", default="optim_grads_params",
      choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
      help="Megatron-FSDP's sharding (Megatron-LM's default: optim_grads_params, ZeRO-3)")
    a("--recompute", action="store_true", help="full recomputation of every layer")
    a("--calculate-per-token-loss", action="store_true",
      help="Megatron's per-token loss: gradients divided by the step's token count")
    a("--bf16", action="store_true", help="bf16 parameters and activations (fp32 main grads)")
    a("--layers", type=int, default=4)
    a("--hidden", type=int, default=64)
    a("--heads", type=int, default=4)
    a("--seq-len", type=int, default=32)
    a("--vocab", type=int, default=256)
    a("--micro-batch-size", type=int, default=2)
    a("--microbatches", type=int, default=4, help="per data-parallel rank and step")
    a("--num-experts", type=int, default=None)
    a("--moe-router-topk", type=int, default=2)
    a("--moe-aux-loss-coeff", type=float, default=0.0, help="Megatron's default: 0 (none)")
    a("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather")
    a("--moe-shared-expert-intermediate-size", type=int, default=None)
    a("--moe-shared-expert-overlap", action="store_true",
      help="the shared expert inside the alltoall dispatcher")
    a("--disable-bias-linear", dest="add_bias_linear", action="store_false",
      help="no biases in the linear layers (Megatron: MoE experts under tp need it)")
    a("--ep", type=int, default=1)
    a("--steps", type=int, default=2)
    a("--lr", type=float, default=3e-3)
    a("--seed", type=int, default=1234)
    return ap.parse_args(argv)


def build(args):
    """Megatron's model chunks (one per virtual stage), DDP-wrapped, and the optimizer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if args.recompute else {}
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        **recompute, calculate_per_token_loss=args.calculate_per_token_loss,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, context_parallel_size=args.cp,
        sequence_parallel=args.sequence_parallel, gradient_accumulation_fusion=False,
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, add_bias_linear=args.add_bias_linear,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
        expert_model_parallel_size=args.ep)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts)
    chunks = []
    for vp in range(args.vpp or 1):
        vp_stage = vp if args.vpp else None
        chunks.append(GPTModel(
            config=cfg, transformer_layer_spec=spec, vocab_size=args.vocab,
            max_sequence_length=args.seq_len, share_embeddings_and_output_weights=True,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage))
    fsdp = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=args.
                data_parallel_sharding_strategy) if args.use_megatron_fsdp else {}
    ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=args.overlap_grad_reduce, **fsdp,
                                            use_distributed_optimizer=args.distributed_optimizer,
                                            bucket_size=args.bucket_size,
                                            overlap_param_gather=args.overlap_param_gather,
                                            # Megatron-LM: on with interleaving, else off
                                            align_param_gather=bool(args.vpp)
                                            and args.align_param_gather,
                                            num_distributed_optimizer_instances=args.
                                            num_distributed_optimizer_instances,
                                            grad_reduce_in_fp32=True)  # Megatron-LM, for bf16
    if args.bf16:  # Megatron-LM's get_model: bf16 parameters, inputs and outputs converted
        from megatron.core.transformer.module import Float16Module
        chunks = [Float16Module(cfg, chunk) for chunk in chunks]
    with_step = args.overlap_param_gather_with_optimizer_step  # Megatron-LM: no bucketing then
    wrapper = DistributedDataParallel
    if args.use_megatron_fsdp:  # Megatron-LM's get_model: its FullyShardedDataParallel
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
        wrapper = FullyShardedDataParallel
    model = [wrapper(config=cfg, ddp_config=ddp_cfg, module=chunk,
                     disable_bucketing=i > 0 or with_step)
             for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=1.0, use_distributed_optimizer=args.distributed_optimizer,
        overlap_param_gather_with_optimizer_step=with_step, bf16=args.bf16), model)
    return cfg, model, optimizer


def install_hooks(cfg, model, args) -> None:
    """What Megatron-LM's ``train()`` sets on the config before the first iteration."""
    from megatron.core.distributed import finalize_model_grads

    if args.overlap_grad_reduce:
        cfg.no_sync_func = [chunk.no_sync for chunk in model]
        if args.align_grad_reduce:
            cfg.grad_sync_func = [chunk.start_grad_sync for chunk in model]
        if len(model) == 1:
            cfg.no_sync_func = cfg.no_sync_func[0]
            cfg.grad_sync_func = cfg.grad_sync_func[0] if args.align_grad_reduce else None
    cfg.finalize_model_grads_func = finalize_model_grads


def batches(args):
    """This rank's microbatches, step after step: windows of the bundled corpus."""
    from megatron.core import parallel_state as ps

    from paraloom.data import Corpus, load_corpus, microbatches

    corpus = Corpus(load_corpus(None), args.seq_len, args.seed)
    dp = ps.get_data_parallel_world_size()
    step = 0
    while True:
        batch = corpus.global_batch(step, args.micro_batch_size * args.microbatches * dp)
        yield from microbatches(batch, ps.get_data_parallel_rank(), dp, args.microbatches)
        step += 1


def forward_step(data_iterator, model):
    """Megatron-LM's ``forward_step`` and ``loss_func``: the summed token loss and the tokens."""
    tokens, labels = next(data_iterator)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    losses = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        loss = output.float().sum()
        count = torch.tensor(output.numel(), dtype=torch.int)
        return loss, count, {"lm loss": torch.cat([loss.detach().view(1), count.view(1)])}
    return losses, loss_func


def agree(value, op, dtype, group):
    """One value reduced over ``group`` (Megatron-LM's model-parallel agreement)."""
    t = torch.tensor([value], dtype=dtype)
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def train_step(step_fn, iterators, model, optimizer, args):
    """Megatron-LM's ``train_step``; returns the loss per token (last stage) and the norm."""
    from megatron.core import parallel_state as ps

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = step_fn(forward_step_func=forward_step,
                     data_iterator=iterators if len(model) > 1 else iterators[0],
                     model=model, num_microbatches=args.microbatches, seq_length=args.seq_len,
                     micro_batch_size=args.micro_batch_size, forward_only=False)
    ok, norm, _ = optimizer.step()
    mp = ps.get_model_parallel_group()
    ok = bool(agree(1 if ok else 0, dist.ReduceOp.MIN, torch.int, mp))
    norm = agree(-1.0 if norm is None else norm, dist.ReduceOp.MAX, torch.float32, mp)
    loss = None
    if ps.is_pipeline_last_stage(ignore_virtual=True) and losses:
        total = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        loss = (total[0] / total[1]).item()
    return loss, norm, ok


def main(argv=None) -> None:
    args = parse(argv)
    if args.use_megatron_fsdp:  # Megatron-LM: Megatron-FSDP implies the distributed optimizer
        args.distributed_optimizer = True
    if args.vpp and args.pp <= 2:
        raise SystemExit(f"--vpp {args.vpp} needs --pp > 2 with megatron-core's blocking batched "
                         f"p2p (Megatron-LM refuses it too: with pp = 2 a batch would hold two "
                         f"sends to the same rank), got --pp {args.pp}")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    torch.manual_seed(args.seed + 100 * ps.get_pipeline_model_parallel_rank())  # as Megatron-LM
    model_parallel_cuda_manual_seed(args.seed)
    cfg, model, optimizer = build(args)
    install_hooks(cfg, model, args)
    step_fn = get_forward_backward_func()
    iterators = [batches(args) for _ in model]
    # Megatron-LM's train(): the pre-hooks (and with interleaving the schedule's param_sync_func)
    # off until a step has succeeded; Megatron-FSDP's own hooks are left alone
    opg = args.overlap_param_gather and not args.use_megatron_fsdp
    hooks = False
    if opg:
        for chunk in model:
            chunk.disable_forward_pre_hook(param_sync=False)
    for step in range(args.steps):
        loss, norm, ok = train_step(step_fn, iterators, model, optimizer, args)
        if opg and ok and not hooks:
            for chunk in model:
                chunk.enable_forward_pre_hook()
            if args.vpp and args.align_param_gather:  # the schedule launches the gathers
                cfg.param_sync_func = [chunk.start_param_sync for chunk in model]
            hooks = True
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"step {step + 1}: loss {loss:.4f}  grad_norm {norm:.3f}"
                  + ("" if ok else "  (skipped)"), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # silences Megatron's advice
    # megatron-core's notes about missing CUDA extensions (Apex, Transformer Engine) and its
    # deprecations, once per rank: not what this example is about
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")
    main()
