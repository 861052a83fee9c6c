"""The communication table's words for expert parallelism (kind ``ep``), in English and Chinese.

Each exchange of a token dispatcher (allgather or alltoall) says what it moves and, from its
recorded split sizes, how many rows went to and came from each rank (a row is one token copy,
``h`` wide, or its fp32 routing probability).
"""

from __future__ import annotations

__all__ = ["ep_split"]

_GATHER = {  # Megatron's default dispatcher: site after its name -> (en, zh)
    "token_permutation.forward:routing_map": (
        "routing map [tokens, E] (bool) of every tp x ep rank",
        "各 tp x ep rank 的路由表 [tokens, E]（bool）"),
    "token_permutation.forward:probs": (
        "routing probabilities [tokens, E] of every tp x ep rank",
        "各 tp x ep rank 的路由概率 [tokens, E]"),
    "token_permutation.forward:tokens": (
        "tokens [tokens, h] of every tp x ep rank",
        "各 tp x ep rank 的 token [tokens, h]"),
    "token_unpermutation.forward:tokens": (
        "expert outputs summed (fp32), each rank keeps its tokens",
        "专家输出求和（fp32），各 rank 保留自己的 token"),
    "token_unpermutation.backward:tokens_grad": (
        "output grads of every rank's tokens (fp32)",
        "各 rank token 的输出梯度（fp32）"),
    "token_permutation.backward:tokens_grad": (
        "token grads summed, back to each rank",
        "token 梯度求和，送回各 rank"),
    "token_permutation.backward:probs_grad": (
        "probability grads summed, back to each rank",
        "概率梯度求和，送回各 rank"),
}
_TEXT = {  # the alltoall dispatcher: site after its name -> (en, zh)
    "token_permutation.forward:tokens_per_expert": (
        "tokens per expert [E] (int64) from every tp x ep rank",
        "每个专家的 token 数 [E]（int64），来自每个 tp x ep rank"),
    "token_permutation.forward:tokens": (
        "tokens to their experts' ranks [rows, h]",
        "token 发往所选专家所在的 rank [行, h]"),
    "token_permutation.forward:probs": (
        "their routing probabilities to the experts' ranks [rows] (fp32)",
        "其路由概率发往专家所在的 rank [行]（fp32）"),
    "token_permutation.forward:tokens_tp": (
        "every tp rank's rows for these experts [rows, h]",
        "各 tp rank 发给这些专家的行 [行, h]"),
    "token_permutation.forward:probs_tp": (
        "every tp rank's row probabilities [rows] (fp32)",
        "各 tp rank 的行概率 [行]（fp32）"),
    "token_unpermutation.forward:tokens_tp": (
        "expert outputs summed over tp, each tp rank keeps its rows [rows, h]",
        "专家输出在 tp 上求和，各 tp rank 保留自己的行 [行, h]"),
    "token_unpermutation.forward:tokens": (
        "expert outputs back to the tokens' ranks [rows, h]",
        "专家输出送回 token 所在的 rank [行, h]"),
    "token_unpermutation.backward:tokens_grad": (
        "expert-output grads to the experts' ranks [rows, h]",
        "专家输出的梯度发往专家所在的 rank [行, h]"),
    "token_unpermutation.backward:tokens_tp_grad": (
        "expert-output grads of every tp rank's rows [rows, h]",
        "各 tp rank 各行的专家输出梯度 [行, h]"),
    "token_permutation.backward:probs_tp_grad": (
        "probability grads summed over tp, back to each tp rank [rows]",
        "概率梯度在 tp 上求和，送回各 tp rank [行]"),
    "token_permutation.backward:tokens_tp_grad": (
        "token grads summed over tp, back to each tp rank [rows, h]",
        "token 梯度在 tp 上求和，送回各 tp rank [行, h]"),
    "token_permutation.backward:probs_grad": (
        "probability grads back to the tokens' ranks [rows]",
        "概率梯度送回 token 所在的 rank [行]"),
    "token_permutation.backward:tokens_grad": (
        "token grads back to the tokens' ranks [rows, h]",
        "token 梯度送回 token 所在的 rank [行, h]"),
}
_PLANNED = {"en": "; rows follow the routing", "zh": "；行数随路由而定"}
"""``plan --table``'s all-to-alls, derived before any routing: no split sizes yet."""
_ROWS = {"en": ("; rows sent {ins}, received {outs}", "; rows per rank {rows}"),
         "zh": ("；发送行数 {ins}，接收行数 {outs}", "；各 rank 的行数 {rows}")}


def ep_split(event: dict, lang: str) -> str | None:
    """The split text of one of the token dispatchers' events (kind ``ep``), or ``None`` when
    it is not one (the caller then uses the event's own ``split``)."""
    site = event.get("site") or ""
    cls, _, rest = site.partition(".")
    words = {"MoEAlltoAllTokenDispatcher": _TEXT,
             "MoEAllGatherTokenDispatcher": _GATHER}.get(cls, {}).get(rest)
    if words is None:
        return None
    text = words[lang == "zh"]
    pair, each = _ROWS[lang]
    if event["op"] == "all_to_all" and "input_splits" not in event:  # plan --table: derived
        text += _PLANNED[lang]
    elif event["op"] == "all_to_all":
        text += pair.format(ins=event["input_splits"], outs=event["output_splits"])
    elif "output_splits" in event or "input_splits" in event:
        text += each.format(rows=event.get("output_splits") or event["input_splits"])
    return text
