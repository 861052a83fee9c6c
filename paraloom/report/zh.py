"""The communication table in Chinese: the split objects paraloom's code names, and the compute
that an asynchronous communication overlaps.

The runtime writes each event's ``split`` in English (it is the ledger's contract); the table
translates it here when ``--lang zh`` is asked, with the phase of the trigger location and the
words of each site's tag (``ColumnParallelLinear input grad`` -> ``ColumnParallelLinear
输入梯度``). Class, function, module and dtype names stay as they are (``ColumnParallelLinear``,
``layers.0.mlp.fc1``, ``float32``): they are what a reader searches the code for. A split this
table does not know is shown as written (a test walks every split that ``train`` and ``record``
produce, so none is left in English); a tag word it does not know too.
"""

from __future__ import annotations

import re

__all__ = ["SPLITS", "PHASES", "TAGS", "split", "compute", "phase", "tag"]

SPLITS = {
    "ColumnParallelLinear weight, output dim": "ColumnParallelLinear 权重，按输出维切分",
    "RowParallelLinear weight, input dim": "RowParallelLinear 权重，按输入维切分",
    "embedding rows, vocabulary range": "词嵌入的行，按词表范围切分",
    "embeddings, sequence slice": "词嵌入，按序列切片",
    "logits, vocabulary range": "logits，按词表范围切分",
    "vocabulary": "词表范围内的部分结果",
    "gradient bucket (replicated)": "梯度桶（各副本相同）",
    "gradient bucket, 1/dp contiguous shard": "梯度桶，每个 dp rank 保留连续的 1/dp 分片",
    "parameter bucket, 1/dp contiguous shard": "参数桶，每个 dp rank 提供连续的 1/dp 分片",
    "gradient shard, summed across optimizer instances": "梯度分片，在各优化器实例间求和",
    "this rank's squared gradient norm": "本 rank 的梯度范数平方",
    "whether any rank has separately-normed parameters": "是否有 rank 含单独求范数的参数",
    "whether this rank updated": "本 rank 是否完成了更新",
    "the gradient norm": "梯度范数",
    "loss sum and token count": "损失之和与 token 数",
    "the step's token count": "本步的 token 总数",
    "this rank's count of zero gradients": "本 rank 的零梯度个数",
    "the count of zero gradients": "零梯度个数",
    "squared norm of this rank's parameter shards": "本 rank 参数分片的范数平方",
    "squared parameter norm of this rank's model part": "本 rank 模型部分的参数范数平方",
    "MoE aux/z losses, drops, tokens/expert": "MoE 辅助损失/z 损失、丢弃数、每个专家的 token 数",
    "expert outputs": "专家输出",
    "expert outputs back to their tokens' ranks": "专家输出送回 token 所在的 rank",
    "token counts per expert": "每个专家的 token 数",
    "shared expert input, sequence": "共享专家的输入，按序列",
    "shared expert output, partial sums over tp": "共享专家的输出，tp 上的部分和",
    "token counts per expert, summed over the microbatch's ranks":
        "每个专家的 token 数，在本微批次的各 rank 上求和",
    "routing probabilities of the rows": "各行的路由概率",
    "routing map [tokens, E] of every rank": "各 rank 的路由表 [tokens, E]",
    "routing probabilities [tokens, E] of every rank": "各 rank 的路由概率 [tokens, E]",
    "tokens [tokens, h] of every rank": "各 rank 的 token [tokens, h]",
    "expert outputs summed, each rank's tokens (fp32)":
        "专家输出求和，各 rank 取自己的 token（fp32）",
    "every tp rank's rows for these experts": "各 tp rank 发给这些专家的行",
    "their routing probabilities": "它们的路由概率",
    "expert outputs summed over tp, each rank's rows": "专家输出在 tp 上求和，各 rank 取自己的行",
    "router logits [tokens, E] of every cp rank": "各 cp rank 的路由 logits [tokens, E]",
    "heads to the cp rank of their group": "按注意力头分组，发往负责该组的 cp rank",
    "positions back to their cp rank": "按序列位置送回所属的 cp rank",
    "tokens by expert (rows to each ep rank's experts)":
        "按专家分组的 token（各行发往对应 ep rank 的专家）",
    "the microbatch's tokens": "本微批次的 token",
    "the microbatch's labels": "本微批次的标签",
    "the microbatch's loss mask": "本微批次的损失掩码",
    "the microbatch's position ids": "本微批次的位置编号",
    "the microbatch's attention mask": "本微批次的注意力掩码",
    "whether any rank re-runs the step": "是否有 rank 要重跑本步",
    "whether any rank has run --exit-duration-in-mins": "是否有 rank 已运行满时限（分钟数上限）",
    "the learning rate, for the log": "学习率（用于日志）",
    "the tied word embeddings' first values": "绑定词嵌入的初始值",
    "the earliest program start over the ranks": "各 rank 中最早的程序启动时间",
    "the earliest training start over the ranks": "各 rank 中最早的训练启动时间",
    "each rank's start-up times, for the log": "各 rank 的启动计时（用于日志）",
    "each rank's set-up times, for the log": "各 rank 的初始化计时（用于日志）",
    "the size of each rank's dense parameter-group keys": "各 rank 稠密参数组键的字节数",
    "the size of each rank's expert parameter-group keys": "各 rank 专家参数组键的字节数",
    "each rank's dense parameter-group keys": "各 rank 的稠密参数组键",
    "each rank's expert parameter-group keys": "各 rank 的专家参数组键",
    "whether to train, validate and test": "是否训练、验证与测试",
}
"""Every split text paraloom's runtime writes, in Chinese."""

_COMPUTE = (
    (re.compile(r"^pipeline\b"), "流水线计算"),
    (re.compile(r"^linear\b"), "线性层"),
    (re.compile(r"\(chunk(\d+)\)"), r"（块 \1）"),
    (re.compile(r"\bdgrad\b"), "输入梯度 GEMM"),
    (re.compile(r"\bwgrad\b"), "权重梯度 GEMM"),
    (re.compile(r"\bfprop\b"), "前向 GEMM"),
    (re.compile(r"\bblocks\b"), "注意力块计算"),
    (re.compile(r"\bforward\b"), "前向"),
    (re.compile(r"\bbackward\b"), "反向"),
)


TAGS = {
    "input": "输入", "input (re-gather)": "输入（重新汇集）", "input_grad": "输入梯度",
    "output": "输出", "output_grad": "输出梯度", "bucket_grads": "梯度桶",
    "unshard": "聚合完整参数", "param_unshard": "聚合完整参数",
    "embedding_grads": "词嵌入梯度", "vote": "投票", "squared_norm": "范数平方",
    "update_successful": "更新是否成功",
    "grad_norm": "梯度范数", "loss": "损失", "learning_rate": "学习率", "flag": "标志",
    "flags": "标志", "max": "最大值", "target_logit": "目标 logits", "sum_exp": "指数和",
    "target_logit_sum_exp": "目标 logits 与指数和",
    "sum_logits": "logits 之和", "logits": "logits",
    "tokens": "token", "num_tokens": "token 总数", "num_zeros": "零梯度个数",
    "sharded_norm": "分片范数", "model_parallel": "模型并行", "labels": "标签",
    "loss_mask": "损失掩码", "position_ids": "位置编号",
    "attention_mask": "注意力掩码", "interval_timer_start": "区间计时器开始",
    "interval_timer_stop": "区间计时器停止", "interval-time": "区间计时",
    "program_start_time": "程序启动时间", "training_start_time": "训练启动时间",
    "compile_dependencies": "编译依赖", "after_training_is_done": "训练结束后",
    "after_in-process_setup": "进程内初始化之后", "after_in-job_setup": "作业内初始化之后",
    "after_megatron_is_initialized": "Megatron 初始化之后",
    "after_model,_optimizer,_and_learning_rate_scheduler_are_built":
        "模型、优化器与学习率调度器构建之后",
    "after_dataloaders_are_built": "数据加载器构建之后",
    "before_the_start_of_training_step": "训练步开始之前", "start-up": "启动",
    "set-up": "初始化", "model-and-optimizer-setup": "模型与优化器初始化",
    "train/valid/test-data-iterators-setup": "训练/验证/测试数据迭代器初始化",
    "train": "训练集", "valid": "验证集", "test": "测试集", "dense": "稠密参数",
    "expert": "专家参数", "kv": "K、V", "dkv": "K、V 的梯度", "q": "Q", "k": "K", "v": "V",
    "out": "注意力输出", "dout": "注意力输出的梯度", "dq": "Q 的梯度", "dk": "K 的梯度",
    "dv": "V 的梯度", "tokens_grad": "token 梯度",
    "tokens_per_expert": "每个专家的 token 数", "moe_stats": "MoE 统计",
    "param_shards": "参数分片", "shard_across_instances": "分片跨优化器实例",
    "gather_optimizer_shards": "汇集优化器分片",
    "sequence_parallel_grads": "序列并行梯度", "setup": "初始化", "clock": "时钟",
    "created": "已创建", "token": "令牌", "token_written": "令牌已写入", "who_sees": "谁能看到",
    "resumed_ledger_time": "续训账本时间", "dgrad": "输入梯度 GEMM", "wgrad": "权重梯度 GEMM",
    "fprop": "前向 GEMM",
}
"""The tags of paraloom's sites (after the ``:``), in Chinese."""


_WORDS = {"input": "输入", "output": "输出", "grad": "梯度", "grads": "梯度", "weight": "权重",
          "tokens": "token", "gather": "汇集", "scatter": "分发", "reduce": "归约",
          "start": "开始", "stop": "停止", "time": "时间"}


def tag(text: str) -> str:
    """A site's tag in Chinese (``input_grad`` -> ``输入梯度``); unknown: word by word where the
    words are known, else as written."""
    if text in TAGS:
        return TAGS[text]
    return "".join(_WORDS.get(w, f" {w} ") for w in text.split("_")).strip()


PHASES = {"forward": "前向", "backward": "反向", "optimizer": "优化器", "setup": "初始化",
          "data": "读数据", "other": "其他", "backward (recompute)": "反向（重算）"}
"""The phase words of the trigger location."""


def phase(word: str) -> str:
    """A phase in Chinese (unchanged when unknown)."""
    return PHASES.get(word, word)


def split(text: str) -> str:
    """The Chinese of a split text the runtime wrote (unchanged when unknown)."""
    return SPLITS.get(text, text)


def compute(name: str) -> str:
    """A compute span's name as the async column lists it (``ColumnParallelLinear wgrad
    (layers.0.mlp.fc1)``, ``pipeline (chunk0)``), its English words in Chinese."""
    for pattern, words in _COMPUTE:
        name = pattern.sub(words, name)
    return name
