"""The four checklist answers and the communication order table, from extracted facts only.

Each answer is ``{"text", "lines"}``: a sentence built from the facts with the lines it rests on,
or "needs more context" (in the chosen language) when the snippet does not decide it.
"""

from __future__ import annotations

import re

from .conditions import phrases
from .rules import UNKNOWN

__all__ = ["QUESTIONS", "answer_all", "order_rows"]

QUESTIONS = {
    "world_size_and_divide": ("Where does world_size come from, and what does divide split?",
                              "world_size 从哪里来，divide 切分的是什么？"),
    "input_vs_weight": ("Does the (scattered) input match the local or the full weight?",
                        "（切分后的）输入对应的是本地权重还是完整权重？"),
    "all_reduce_phase": ("Is the all-reduce in forward or backward, and which gradient does it "
                         "sync?", "all-reduce 发生在前向还是反向？同步的是哪个梯度？"),
    "sp_forbids_async": ("Why does sequence_parallel forbid async_grad_allreduce?",
                         "为什么 sequence_parallel 与 async_grad_allreduce 不能同时开启？"),
}
_NMC = {"en": UNKNOWN, "zh": "需要更多上下文"}
_T = {
    "ws": ("{name} = {source} (line {line}, group: {group})",
           "{name} = {source}（第 {line} 行，通信组：{group}）"),
    "div": ("line {line}: {what} is split into {parts} parts{origin} -> {into}",
            "第 {line} 行：{what} 被切成 {parts} 份{origin}，结果存入 {into}"),
    "origin": (" ({name} = {source}, line {line})", "（{name} = {source}，第 {line} 行）"),
    "col": ("{cls}: the local weight {name} is [{shape}] (line {line}), split on the output dim, "
            "so the input stays full on its last dim and each rank computes its own slice of "
            "the output{feed}",
            "{cls}：本地权重 {name} 为 [{shape}]（第 {line} 行），按输出维切分，因此输入的最后一维"
            "保持完整，每个 rank 计算输出的一部分{feed}"),
    "row": ("{cls}: the local weight {name} is [{shape}] (line {line}), split on the input dim, "
            "so the input must be split on its last dim to match the local weight, not the "
            "full one{feed}; the partial outputs are then summed",
            "{cls}：本地权重 {name} 为 [{shape}]（第 {line} 行），按输入维切分，因此输入必须在"
            "最后一维上切分以对应本地权重而非完整权重{feed}；各 rank 的部分输出随后求和"),
    "emb": ("{cls}: the local table {name} holds a vocabulary range (line {line}); ids outside it "
            "give zeros and the partial rows are summed",
            "{cls}：本地词表 {name} 只含一段词表范围（第 {line} 行）；范围外的 id 得到零，各 rank "
            "的部分结果再求和"),
    "feed": ("; input via {via} (line {line}, {phase})",
             "；输入经由 {via}（第 {line} 行，{phase}）"),
    "ar": ("line {line} ({where}): all_reduce in {phase}{cond} — {what}",
           "第 {line} 行（{where}）：all_reduce 在{phase}{cond} —— {what}"),
    "ar_bwd": ("syncs the gradient of the layer input (each rank holds a partial sum of it): {arg}",
               "同步层输入的梯度（每个 rank 持有其部分和）：{arg}"),
    "ar_fwd": ("sums partial outputs (activations), not a gradient: {arg}",
               "对部分输出（激活）求和，不是梯度：{arg}"),
    "ar_dp": ("syncs parameter gradients across data-parallel replicas: {arg}",
              "在数据并行副本之间同步参数梯度：{arg}"),
    "ar_dp_value": ("sums {arg} across data-parallel replicas (by its name not a gradient: a "
                    "loss, a count or a statistic)",
                    "在数据并行副本之间对 {arg} 求和（从名称看不是梯度：损失、计数或统计量）"),
    "sp": ("with sequence parallelism the input gradient is reduce-scattered (line {rs}{rs_async}) "
           "instead of all-reduced{ar}: the reduce-scatter already sums the partial gradients "
           "and leaves each rank its [s/tp] shard, which is what the sequence-parallel input "
           "needs, so an all-reduce on top would reduce twice and return the full sequence; "
           "and the overlap that async_grad_allreduce buys (launch before the wgrad GEMM) is "
           "already there",
           "开启序列并行时，输入梯度做的是 reduce-scatter（第 {rs} 行{rs_async}）而不是 "
           "all-reduce{ar}：reduce-scatter 已经完成部分梯度求和，并且给每个 rank 留下它的 "
           "[s/tp] 分片，这正是序列并行输入所需要的；再做 all-reduce 会重复归约并得到完整序列；"
           "而 async_grad_allreduce 想要的重叠（在 wgrad GEMM 之前发起通信）已经存在"),
    "guard": ("; the code forbids the combination at line {line}",
              "；代码在第 {line} 行禁止两者同时开启"),
    "guard_only": ("the code forbids the combination at line {line}; why (which reduction "
                   "sequence parallelism does instead) is outside the snippet",
                   "代码在第 {line} 行禁止两者同时开启；原因（序列并行改用哪种归约）不在片段中"),
}
_PHASE_ZH = {"forward": "前向", "backward": "反向"}


def _t(key: str, lang: str, **kw) -> str:
    return _T[key][lang == "zh"].format(**kw)


def _main_sites(facts: dict) -> list[dict]:
    """Sites outside helper functions (a helper's sites reappear at its call sites)."""
    return [s for s in facts["sites"] if not s["helper"] and s["phase"] != "symbolic"]


def _world(facts, lang):
    parts, lines = [], []
    for w in facts["world_sizes"]:
        parts.append(_t("ws", lang, **w))
        lines.append(w["line"])
    for p in facts["partitions"]:
        o = p["parts_from"]
        origin = _t("origin", lang, **o) if o else ""
        parts.append(_t("div", lang, line=p["line"], what=p["what"], parts=p["parts"],
                        origin=origin, into=p["into"] or "—"))
        lines += [p["line"]] + ([o["line"]] if o else [])
    return parts, lines


def _inputs(facts, lang):
    parts, lines = [], []
    seen = set()
    for w in facts["weights"]:
        if w["partition_dim"] is None or (w["class"], w["name"]) in seen:
            continue
        seen.add((w["class"], w["name"]))
        mine = [s for s in _main_sites(facts) if s["class"] == w["class"] and s["via"]
                and re.search(r"copy_to|scatter_to|gather_from_sequence|linear_with",
                              s["via"][0])]
        feed = "".join(_t("feed", lang, via=s["via"][0], line=s["line"],
                          phase=_PHASE_ZH.get(s["phase"], s["phase"]) if lang == "zh"
                          else s["phase"]) for s in mine[:2])
        shape = ", ".join(w["shape"]) if w["shape"] else f"partition_dim={w['partition_dim']}"
        key = {"column-parallel": "col", "row-parallel": "row"}.get(
            w["layout"], "emb" if "vocab" in w["layout"] else None)
        if key:
            parts.append(_t(key, lang, cls=w["class"] or "?", name=w["name"], shape=shape,
                            line=w["line"], feed=feed))
            lines += [w["line"]] + [s["line"] for s in mine[:2]]
    return parts, lines


def _dp_what(arg: str, phase: str) -> str:
    """A data-parallel all-reduce syncs gradients when it runs in backward (a gradient hook) or
    its tensor is named as gradients or their bucket/buffer; otherwise (the loss, a token count,
    a norm after the step) saying "gradients" would be a false fact."""
    named = re.search(r"grad|bucket|buffer", arg or "", re.IGNORECASE)
    return "ar_dp" if phase == "backward" or named else "ar_dp_value"


def _all_reduce(facts, lang):
    parts, lines = [], []
    sites = [s for s in facts["sites"] if s["op"] == "all_reduce" and s["phase"] != "symbolic"]
    main = [s for s in sites if not s["helper"]] or sites
    for s in main:
        arg = s["arg"] or s["call"]
        what = (_dp_what(arg, s["phase"]) if s["kind"] == "dp" else "ar_bwd"
                if s["phase"] == "backward" else "ar_fwd" if s["phase"] == "forward" else None)
        phase = _PHASE_ZH.get(s["phase"], s["phase"]) if lang == "zh" else s["phase"]
        if s["phase"] == UNKNOWN:
            phase = _NMC[lang]
        text = phrases(s.get("parts", []), lang) or s["condition"]
        cond = f" [{'if' if lang == 'en' else '条件'} {text}]" if s["condition"] else ""
        where = ".".join(x for x in (s["class"], s["function"]) if x)
        parts.append(_t("ar", lang, line=s["line"], where=where, phase=phase, cond=cond,
                        what=_t(what, lang, arg=arg) if what else _NMC[lang]))
        lines.append(s["line"])
    return parts, lines


def _sp_async(facts, lang, guards):
    bwd = [s for s in facts["sites"] if s["phase"] == "backward"]
    rs = [s for s in bwd if s["op"] == "reduce_scatter" and s["kind"] == "sp"
          and not s["via"]] or [s for s in bwd if s["op"] == "reduce_scatter"
                                and s["kind"] == "sp" and s["async"] is True]
    ar = [s for s in bwd if s["op"] == "all_reduce" and s["async"] is True]
    guard = "".join(_t("guard", lang, line=g) for g in guards[:2])
    if rs:
        r = rs[0]
        text = _t("sp", lang, rs=r["line"], rs_async=(", async" if lang == "en" else "，异步")
                  if r["async"] is True else "",
                  ar=(f" (line {ar[0]['line']})" if lang == "en" else f"（第 {ar[0]['line']} 行）")
                  if ar else "") + guard
        return [text], [r["line"]] + ([ar[0]["line"]] if ar else []) + guards[:2]
    if guards:
        return [_t("guard_only", lang, line=guards[0])], guards[:1]
    return [], []


def answer_all(facts: dict, guards: list[int], lang: str = "en") -> dict:
    """``{question_key: {"question", "text", "lines"}}``; ``guards`` are the lines that reject
    sequence_parallel together with an async all-reduce."""
    out = {}
    for key, fn in (("world_size_and_divide", _world), ("input_vs_weight", _inputs),
                    ("all_reduce_phase", _all_reduce)):
        parts, lines = fn(facts, lang)
        out[key] = {"text": "; ".join(parts) if parts else _NMC[lang],
                    "lines": sorted(set(lines))}
    parts, lines = _sp_async(facts, lang, guards)
    out["sp_forbids_async"] = {"text": "; ".join(parts) if parts else _NMC[lang],
                               "lines": sorted(set(lines))}
    for key, value in out.items():
        value["question"] = QUESTIONS[key][lang == "zh"]
    return out


def order_rows(facts: dict) -> list[dict]:
    """Sites in static execution order: forward in source order, then backward, where a
    region's backward half runs in reverse order of the forward calls and the body of an
    autograd ``backward`` in source order."""
    layout = {w["class"]: f"{w['class']} weight, {w['meaning'].split(' (')[0]}"
              for w in facts["weights"] if w["partition_dim"] is not None and w["class"]}
    rank = {"forward": 0, "backward": 1}

    def key(s):
        r = rank.get(s["phase"], 2)
        if r == 1:
            return (r, -(s["line"] if s["via"] else s.get("fn_line") or s["line"]),
                    s["inner_line"] or 0 if s["via"] else s["line"])
        return (r, s["line"], s["inner_line"] or 0)

    rows = []
    for s in sorted(_main_sites(facts), key=key):
        where = ".".join(x for x in (s["class"], s["function"]) if x) or "module"
        via = f" via {s['via'][0]}" if s["via"] else ""
        rows.append({"index": len(rows) + 1, "parallel_type": s["kind"],
                     "split_object": layout.get(s["class"]) or s.get("moved") or "—",
                     "primitive": s["op"],
                     "trigger_location": f"{s['phase']} · {where} (line {s['line']}){via}",
                     "async": s["async"], "condition": s["condition"], "line": s["line"],
                     "parts": s.get("parts", [])})
    return rows
