"""The communication table's words for expert parallelism (kind ``ep``), in English and Chinese.

Each all-to-all of the token dispatcher says what it moves and, from its recorded split sizes,
how many rows went to and came from each ep rank (a row is one token copy, ``h`` wide).
"""

from __future__ import annotations

__all__ = ["ep_split"]

_TEXT = {  # (site fragment, phase) -> (en, zh)
    (":tokens_per_expert", "forward"): (
        "tokens per expert [E] (int64) to every ep rank",
        "每个专家的 token 数 [E]（int64），发往各 ep rank"),
    (".token_permutation", "forward"): (
        "tokens to their experts' ranks [rows, h]",
        "token 发往所选专家所在的 rank [行, h]"),
    (".token_unpermutation", "forward"): (
        "expert outputs back to the tokens' ranks [rows, h]",
        "专家输出送回 token 所在的 rank [行, h]"),
    (".token_unpermutation", "backward"): (
        "expert-output grads to the experts' ranks [rows, h]",
        "专家输出的梯度发往专家所在的 rank [行, h]"),
    (".token_permutation", "backward"): (
        "token grads back to the tokens' ranks [rows, h]",
        "token 梯度送回 token 所在的 rank [行, h]"),
}
_ROWS = {"en": "; rows sent {ins}, received {outs}", "zh": "；发送行数 {ins}，接收行数 {outs}"}


def ep_split(event: dict, lang: str) -> str | None:
    """The split text of an ep all-to-all event, or ``None`` when it is not one of the
    dispatcher's (the caller then uses the event's own ``split``)."""
    site = event.get("site") or ""
    for (fragment, phase), words in _TEXT.items():
        if fragment in site and event["phase"] == phase:
            text = words[lang == "zh"]
            if "input_splits" in event and fragment != ":tokens_per_expert":
                text += _ROWS[lang].format(ins=event["input_splits"],
                                           outs=event["output_splits"])
            return text
    return None
