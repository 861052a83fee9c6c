"""The communication order table: what one rank communicated in one step, in execution order.

One row per communication (compute spans are not rows, but they say what an asynchronous
operation overlapped: every compute span running between its launch and its completion), with the
columns of SPEC.md — parallel type, split object, primitive, trigger location (phase · site ·
module), async — in English or Chinese headings, as Markdown, CSV or JSON. ``group=True`` folds
consecutive layers and microbatches that communicate alike (:mod:`.fold`), so a deep model's
table stays readable. Events recorded without a ``split``
(pipeline p2p, the tied-embedding and sp finalize sums, the loss reduction) get a description
of what travels, e.g. ``activations [16, 1, 32] to the next stage``.

A recorded program's communication before its first iteration is its own section, ``setup``
(``--step setup``); a step's table never holds it. The command is ``paraloom table RUN_DIR
[--lang en|zh] [--format md|csv|json] [--rank R] [--step N|setup] [--group]``
(:mod:`paraloom.commands.table`).
"""

from __future__ import annotations

import csv
import io
import json

from . import zh
from .fold import group_rows
from .moe_rows import ep_split

__all__ = ["HEADINGS", "KEYS", "table_rows", "render_table", "group_rows", "steps_of",
           "numbered_steps", "FROM_ONE"]

HEADINGS = {
    "en": ("#", "Parallel type", "Split object", "Primitive", "Trigger location", "Async"),
    "zh": ("#", "并行类型", "切分对象", "通信原语", "触发位置", "是否异步"),
}
"""Column headings per language (the first, ``#``, is the execution order)."""
KEYS = ("index", "parallel_type", "split_object", "primitive", "trigger_location", "async")
_WORDS = {"en": ("yes", "no", "overlaps"), "zh": ("是", "否", "重叠")}


def _site(site: str, lang: str = "en") -> str:
    """``ColumnParallelLinear.backward:input_grad`` -> ``ColumnParallelLinear input grad``
    (``zh``: the tag's words in Chinese, the code name kept); a recorded program's
    ``path/to/file.py:LINE function`` -> ``file.py:LINE function``."""
    head, _, tag = site.partition(":")
    if head.endswith(".py"):
        return f"{head.rsplit('/', 1)[-1]}:{tag}"
    for phase in (".forward", ".backward", ".optimizer", ".setup"):
        head = head.removesuffix(phase)
    return f"{head} {tag.replace('_', ' ') if lang == 'en' else zh.tag(tag)}".strip()


_FILL = {  # split text for events recorded without one: (kind, op, phase) or kind
    "en": {("pp", "send", "forward"): "activations {shape} to the next stage",
           ("pp", "recv", "forward"): "activations {shape} from the previous stage",
           ("pp", "send", "backward"): "activation grads {shape} to the previous stage",
           ("pp", "recv", "backward"): "activation grads {shape} from the next stage",
           "pp": "activations {shape} between stages",
           "emb": "tied word-embedding grads [V/tp, h], first + last stage",
           "loss": "per-rank partial sums (grad norm², loss)",
           "sp": "sequence-parallel replicated grads (LayerNorms, row biases)",
           ("cp", "send", "forward"): "K,V {shape} of two sequence chunks to the next cp rank",
           ("cp", "recv", "forward"): "K,V {shape} of two sequence chunks from the previous "
                                      "cp rank",
           ("cp", "send", "backward"): "K,V or the dK,dV sum {shape} to the next cp rank",
           ("cp", "recv", "backward"): "K,V or the dK,dV sum {shape} from the previous cp rank",
           ("cp", "all_gather", "forward"): "K,V {shape} of this rank's two sequence chunks",
           ("cp", "reduce_scatter", "backward"): "dK,dV {shape} of the whole sequence; each "
                                                 "rank keeps its two chunks",
           "cp": "K,V {shape} of sequence chunks"},
    "zh": {("pp", "send", "forward"): "激活 {shape}，发往下一流水级",
           ("pp", "recv", "forward"): "激活 {shape}，来自上一流水级",
           ("pp", "send", "backward"): "激活梯度 {shape}，发往上一流水级",
           ("pp", "recv", "backward"): "激活梯度 {shape}，来自下一流水级",
           "pp": "流水级之间的激活 {shape}",
           "emb": "共享词嵌入梯度 [V/tp, h]，首末流水级",
           "loss": "各 rank 的部分和（梯度范数²、损失）",
           "sp": "序列并行下复制参数的梯度（LayerNorm、行并行偏置）",
           ("cp", "send", "forward"): "两个序列块的 K,V {shape}，发往下一个 cp rank",
           ("cp", "recv", "forward"): "两个序列块的 K,V {shape}，来自上一个 cp rank",
           ("cp", "send", "backward"): "K,V 或 dK,dV 累加和 {shape}，发往下一个 cp rank",
           ("cp", "recv", "backward"): "K,V 或 dK,dV 累加和 {shape}，来自上一个 cp rank",
           ("cp", "all_gather", "forward"): "本 rank 两个序列块的 K,V {shape}",
           ("cp", "reduce_scatter", "backward"): "整条序列的 dK,dV {shape}，各 rank 保留自己的两块",
           "cp": "序列块的 K,V {shape}"},
}


_NOUNS = {  # what a recorded program's tensor is, where its site and phase say (_recorded)
    "en": {"norm": "gradient norm", "grad": "gradients", "param": "parameters",
           "setup": "set-up values"},
    "zh": {"norm": "梯度范数", "grad": "梯度", "param": "参数", "setup": "初始化数据"},
}


def _recorded(event: dict, lang: str) -> str:
    """A recorded program's event (its ``site`` is a ``file.py:LINE function``, it names no
    split): the dtype and shape of the tensor, and what it is where that is known — set-up
    values in setup (an all-reduce in an ``__init__`` is not a gradient); a gradient norm,
    gradients or parameters when the function's name says so (``get_grad_norm_fp32``,
    ``start_grad_sync``, ``_allreduce_embedding_grad``, ``start_param_sync``); gradients for a
    call made while a parameter's gradient was accumulated (``param_grad``: DDP's bucket hooks).
    Nothing is guessed from the phase alone: a forward all-gather may gather activations
    (sequence parallelism) or parameters (FSDP)."""
    if event["op"] == "barrier":  # nothing travels
        return "—"
    function = (event.get("site") or "").rpartition(" ")[2].rpartition(".")[2].lower()
    nouns, noun = _NOUNS[lang], None
    if event["phase"] == "setup":
        noun = nouns["setup"]
    elif "norm" in function:
        noun = nouns["norm"]
    elif event.get("param_grad") or ("grad" in function and event["phase"] != "forward"):
        noun = nouns["grad"]
    elif "param" in function and event["phase"] != "forward":
        noun = nouns["param"]
    shape = f" {list(event['shape'])}" if event.get("shape") is not None else ""
    tensor = f"{event.get('dtype') or 'tensor'}{shape}"
    return f"{noun}, {tensor}" if noun else tensor


def _split(event: dict, lang: str) -> str:
    """The event's ``split``; for pp, emb, loss and finalize-sp events recorded without one, a
    description of what travels (pp: the event's sequence-first shape, else ``[s, b, h]``); for
    a recorded program's events (which name no split), what :func:`_recorded` reads from them
    (pipeline p2p: activations or their grads by the phase the schedule's code gave them)."""
    if event["kind"] == "ep":  # the token dispatcher's words
        text = ep_split(event, lang)
        if text is not None:
            return text
    if event.get("split"):
        return event["split"]
    kind, fill = event["kind"], _FILL[lang]
    shape = str(list(event["shape"])) if event.get("shape") else "[s, b, h]"
    if ".py:" in (event.get("site") or ""):  # a recorded program
        text = fill.get((kind, event["op"], event["phase"])) if kind == "pp" else None
        return text.format(shape=shape) if text else _recorded(event, lang)
    text = fill.get((kind, event["op"], event["phase"])) or fill.get(kind)
    if text is None or (kind == "sp" and event["op"] != "all_reduce"):
        return "—"
    return text.format(shape=shape)


def _phase(event: dict) -> str:
    return "backward (recompute)" if event.get("recompute") else event["phase"]


FROM_ONE = " (steps count from 1, as Megatron's iterations; what came before step 1 is 'setup')"
"""What an error about step 0 adds."""


def steps_of(events: list[dict]) -> list:
    """The sections of a ledger that hold communication: ``"setup"`` (before the first
    iteration) if any, then its step numbers (an event without one is in none)."""
    comms = [e for e in events if e["op"] != "compute"]
    setup = any(e.get("phase") == "setup" for e in comms)
    steps = {e.get("step") for e in comms if e.get("phase") != "setup"}
    return (["setup"] if setup else []) + sorted(s for s in steps if isinstance(s, int))


def numbered_steps(events: list[dict]) -> list[int]:
    """The step numbers that hold communication (:func:`steps_of` without ``"setup"``)."""
    return [s for s in steps_of(events) if s != "setup"]


def _select(events: list[dict], rank: int, step) -> list[dict]:
    """``rank``'s events of ``step``: a step number (``setup`` events are not part of it), or
    ``"setup"``; ``None``: the first step (setup when there is nothing else)."""
    mine = [e for e in events if e["rank"] == rank]
    if not mine:
        ranks = sorted({e["rank"] for e in events})
        raise ValueError(f"rank {rank} has no events in this ledger; ranks present: {ranks}")
    sections = steps_of(mine)
    if step is None and not sections:  # this rank communicated nothing: an empty table
        return []
    if step is None:
        step = next((s for s in sections if s != "setup"), sections[0])
    if step not in sections:
        raise ValueError(f"step {step} has no events on rank {rank}; steps present: "
                         f"{', '.join(map(str, sections))}{FROM_ONE if step == 0 else ''}")
    chosen = [e for e in mine if e.get("phase") == "setup"] if step == "setup" else \
        [e for e in mine if e["step"] == step and e.get("phase") != "setup"]
    return sorted(chosen, key=lambda e: (e["t_start"], e["seq"]))


def _summary(names: list[str], spans: list[dict], lang: str) -> str:
    """The overlapped spans by name, or, past three, counted by kind (``ColumnParallelLinear
    wgrad x4``) so a row stays readable; the ``overlaps`` field keeps the full list."""
    if len(names) <= 3:
        return "; ".join(names)
    counts: dict[str, int] = {}
    for span in spans:
        site = _site(span["site"]) if lang == "en" else zh.compute(_site(span["site"]))
        counts[site] = counts.get(site, 0) + 1
    return "; ".join(f"{site} x{n}" if n > 1 else site for site, n in counts.items())


def table_rows(events: list[dict], *, rank: int = 0, step: int | str | None = None,
               lang: str = "en") -> list[dict]:
    """One dict per communication of ``rank`` in ``step`` (a number, or ``"setup"``; default:
    its first step), in order of launch: the table columns under :data:`KEYS` plus the raw
    fields behind them."""
    yes, no, overlaps = _WORDS[lang]
    chosen = _select(events, rank, step)
    spans = [e for e in chosen if e["op"] == "compute"]
    rows = []
    for e in chosen:
        if e["op"] == "compute":
            continue
        over = [s for s in spans if s["t_start"] < e["t_end"] and s["t_end"] > e["t_start"]]
        names = [_site(s["site"]) + (f" ({s['module']})" if s.get("module") else "")
                 for s in over]
        shown = [zh.compute(n) for n in names] if lang == "zh" else names
        asynchronous = yes if e["async"] else no
        if e["async"] and names:
            asynchronous += f", {overlaps}: " + _summary(shown, over, lang)
        where = _phase(e) if lang == "en" else zh.phase(_phase(e))
        location = " · ".join(x for x in (where, _site(e["site"], lang), e.get("module")) if x)
        rows.append({"index": len(rows) + 1, "parallel_type": e["kind"],
                     "split_object": zh.split(_split(e, lang)) if lang == "zh"
                     else _split(e, lang), "primitive": e["op"],
                     "trigger_location": location, "async": asynchronous, "count": 1,
                     "seq": e["seq"], "step": e["step"], "microbatch": e["microbatch"],
                     "phase": e["phase"], "site": e["site"], "module": e.get("module"),
                     "bytes": e["bytes"], "overlaps": names if e["async"] else []})
    return rows


def render_table(events: list[dict], *, rank: int = 0, step: int | str | None = None,
                 lang: str = "en", fmt: str = "md", group: bool = False) -> str:
    """The table as Markdown (``md``), CSV or JSON (``{"rank", "step", "columns", "rows"}``)."""
    if lang not in HEADINGS:
        raise ValueError(f"lang must be one of {sorted(HEADINGS)}, got {lang!r}")
    if fmt not in ("md", "csv", "json"):
        raise ValueError(f"format must be md, csv or json, got {fmt!r}")
    rows = table_rows(events, rank=rank, step=step, lang=lang)
    if group:
        rows = group_rows(rows, lang, KEYS)
    heads = HEADINGS[lang]
    if fmt == "json":
        step_no = rows[0]["step"] if rows else step
        columns = dict(zip(KEYS, heads, strict=True))
        return json.dumps({"rank": rank, "step": step_no, "columns": columns, "rows": rows},
                          ensure_ascii=False, indent=1)
    cells = [[str(r[k]) for k in KEYS] for r in rows]
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(heads)
        writer.writerows(cells)
        return buf.getvalue()
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    return "\n".join(lines) + "\n"
