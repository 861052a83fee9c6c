"""Megatron-LM's GPT pretraining through ``megatron.training.pretrain``, written from its API.

Megatron-LM's own ``pretrain_gpt.py`` cannot be shipped here; this program drives the same
machinery the same way: Megatron-LM's argument parser and validation
(``parse_and_validate_args``), its config container, ``pretrain`` (``initialize_megatron``, the
model, optimizer and scheduler, ``train()`` with ``train_step``, ``training_log``, timers and the
rerun state machine), megatron-core's ``GPTModel`` with the local layer spec, mock data through
``BlendedMegatronDatasetBuilder``, and each microbatch broadcast over tp from tp rank 0
(``get_batch_on_this_tp_rank``). On CPU ranks, under ``paraloom record`` (README, "Record
Megatron-Core itself")::

    paraloom record --megatron-on-cpu --nproc 4 -- examples/megatron_lm_pretrain.py \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \\
        --train-iters 3 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 \\
        --transformer-impl local --no-gradient-accumulation-fusion --no-bias-gelu-fusion \\
        --no-bias-dropout-fusion --no-masked-softmax-fusion --no-persist-layer-norm \\
        --no-rope-fusion --position-embedding-type learned_absolute --eval-iters 0 \\
        --eval-interval 1000 --distributed-backend gloo --use-cpu-initialization \\
        --hidden-dropout 0 --attention-dropout 0 --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2
"""

from __future__ import annotations

import time
from functools import partial

import torch

_PROGRAM_START = time.time()  # as pretrain_gpt.py: its start-up report spans the imports


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    """megatron-core's GPTModel for this stage (and virtual stage), from Megatron-LM's args
    (with ``--num-experts``, its MLPs are MoE layers)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, vp_stage=vp_stage,
        pg_collection=pg_collection)


def _batch(data_iterator, vp_stage=None):
    """This rank's microbatch: tp rank 0 reads it, every tp rank receives it by broadcast."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    tp_rank = ps.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: (batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None)
                 for k in keys}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
        broadcast_group=ps.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=ps.is_pipeline_first_stage(),
        is_pipeline_last_stage=ps.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                      cp_group=ps.get_context_parallel_group())
    return tuple(batch.get(k) for k in keys)


def loss_func(loss_mask, output_tensor):
    """The summed masked loss, its token count, and what training_log reports."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    """One microbatch forward; the loss function closes over its loss mask."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = _batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(num_samples, vp_stage=None):
    """Mock GPT datasets, built on the ranks that read data (tp rank 0 of the first and last
    stages), as Megatron-LM builds them."""
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None,
        blend_per_split=None, split=args.split, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)

    def built_here():
        return is_first_or_last_pipeline_stage(vp_stage) \
            and ps.get_tensor_model_parallel_rank() == 0
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, built_here, config).build()


def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, set_startup_timestamps
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    cfg = pretrain_cfg_container_from_args(args)
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)


if __name__ == "__main__":
    main()
