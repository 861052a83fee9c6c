"""The communication table in Chinese: the split objects paraloom's code names, and the compute
that an asynchronous communication overlaps.

The runtime writes each event's ``split`` in English (it is the ledger's contract); the table
translates it here when ``--lang zh`` is asked, with the phase of the trigger location. Class,
module, site and dtype names stay as they are (``ColumnParallelLinear input grad``,
``layers.0.mlp.fc1``, ``float32``): they are what a reader searches the code for. A split this
table does not know is shown as written (a test walks every split that ``train`` and ``record``
produce, so none is left in English).
"""

from __future__ import annotations

import re

__all__ = ["SPLITS", "PHASES", "split", "compute", "phase"]

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
    "this rank's squared gradient norm": "本 rank 的梯度范数平方",
    "whether any rank has separately-normed parameters": "是否有 rank 含单独求范数的参数",
    "whether this rank updated": "本 rank 是否完成了更新",
    "the gradient norm": "梯度范数",
    "loss sum and token count": "损失之和与 token 数",
    "MoE aux/z losses, drops, tokens/expert": "MoE 辅助损失/z 损失、丢弃数、每个专家的 token 数",
    "expert outputs": "专家输出",
    "expert outputs back to their tokens' ranks": "专家输出送回 token 所在的 rank",
    "token counts per expert": "每个专家的 token 数",
    "token counts per expert and tokens, summed over cp":
        "每个专家的 token 数与 token 总数，在 cp 上求和",
    "router logits [tokens, E] of every cp rank": "各 cp rank 的路由 logits [tokens, E]",
    "tokens by expert (rows to each ep rank's experts)":
        "按专家分组的 token（各行发往对应 ep rank 的专家）",
    "the microbatch's tokens": "本微批次的 token",
    "the microbatch's labels": "本微批次的标签",
    "the microbatch's loss mask": "本微批次的损失掩码",
    "the microbatch's position ids": "本微批次的位置编号",
    "the microbatch's attention mask": "本微批次的注意力掩码",
    "whether any rank re-runs the step": "是否有 rank 要重跑本步",
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
    (re.compile(r"\bforward\b"), "前向"),
    (re.compile(r"\bbackward\b"), "反向"),
)


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
