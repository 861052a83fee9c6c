"""``explain --ask`` grounded in the reading: the question a model is sent, and the sentences of
its answer that contradict the facts.

The question holds the numbered code and the extracted facts (:func:`question`, with the system
text :data:`SYSTEM`); the model is asked through :mod:`paraloom.llm`, which knows nothing of the
reader. :func:`contradictions` then flags an op put in the wrong phase or at lines that do not
hold it, and a cited line outside the snippet.
"""

from __future__ import annotations

import json
import re

from .source import Snippet

__all__ = ["SYSTEM", "question", "contradictions"]

SYSTEM = ("You explain Megatron-style parallel-training code. Answer only from the numbered "
          "code and the extracted facts below; cite line numbers; say 'needs more context' "
          "when the code shown does not decide the question. Do not invent code.")
"""The system text of every question: answer from the code and the facts only."""


def _facts_brief(facts: dict) -> str:
    keep = {"sites": ["line", "class", "function", "phase", "op", "kind", "async", "condition",
                      "via"],
            "partitions": ["line", "what", "parts", "into"],
            "world_sizes": ["line", "name", "source", "group"],
            "weights": ["line", "name", "shape", "partition_dim", "layout"]}
    brief = {k: [{f: x.get(f) for f in fields} for x in facts[k]] for k, fields in keep.items()}
    brief["answers"] = {k: v["text"] for k, v in facts["answers"].items()}
    return json.dumps(brief, ensure_ascii=False)


def question(text: str, snippet: Snippet, facts: dict, lang: str = "en") -> str:
    """The user text for ``text`` about ``snippet``: the question, the numbered code and the
    facts (JSON), and the language to answer in."""
    return (f"Question: {text}\n\nCode ({snippet.name}, lines {snippet.first}-"
            f"{snippet.last}):\n{snippet.numbered()}\n\nExtracted facts (JSON):\n"
            f"{_facts_brief(facts)}\n\nAnswer in {'Chinese' if lang == 'zh' else 'English'}.")


_OPS = {"all_reduce": r"all[-_ ]?reduce|allreduce", "all_gather": r"all[-_ ]?gather",
        "reduce_scatter": r"reduce[-_ ]?scatter", "all_to_all": r"all[-_ ]?to[-_ ]?all",
        "broadcast": r"\bbroadcast"}
_PHASE_WORDS = {"forward": r"\bforward\b|前向", "backward": r"\bbackward\b|反向"}
_LINE_REF = re.compile(r"\blines?\s+(\d+)((?:\s*(?:[-\u2013\u2014]|to|,|and|&)\s*\d+)*)"
                       r"|\u7b2c\s*(\d+)((?:\s*[-\u2013\u81f3\u5230\u3001,\u548c]\s*\d+)*)"
                       r"\s*\u884c", re.I)
_RANGE_SEP = re.compile(r"[-\u2013\u2014\u81f3\u5230]|to", re.I)


def _cited(sentence: str) -> list[tuple[int, int]]:
    """The line ranges a sentence cites: "line 5", "lines 9-11", "lines 4 and 10", "第 5 行"."""
    out = []
    for m in _LINE_REF.finditer(sentence):
        first, tail = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        out.append((int(first), int(first)))
        for sep, n in re.findall(r"\s*(\D+?)\s*(\d+)", tail or ""):
            if _RANGE_SEP.fullmatch(sep.strip()):
                out[-1] = (out[-1][0], int(n))
            else:
                out.append((int(n), int(n)))
    return out


def contradictions(answer: str, facts: dict) -> list[str]:
    """Sentences of ``answer`` that contradict a fact: an op placed in a phase where the snippet
    has none of it (while it has that op elsewhere), a cited line outside the snippet, or an op
    placed at lines of the snippet that do not hold it (while other lines do; one line of
    slack for a call spread over two lines)."""
    flags = []
    first, last = facts["lines"]
    for sentence in re.split(r"(?<=[.!?\u3002\uff01\uff1f])\s*|\n+", answer):
        cited = _cited(sentence)
        clauses = [(c, [(a, b) for a, b in _cited(c) if first <= a <= b <= last])
                   for c in re.split(r";|\uff1b|\bwhile\b|\bwhereas\b", sentence)]
        for op, pattern in _OPS.items():
            if not re.search(pattern, sentence, re.IGNORECASE):
                continue
            phases = {s["phase"] for s in facts["sites"] if s["op"] == op}
            lines = sorted({n for s in facts["sites"] if s["op"] == op
                            for n in (s["line"], s.get("inner_line")) if n})
            said = [ph for ph, w in _PHASE_WORDS.items() if re.search(w, sentence, re.I)]
            if len(said) == 1 and phases and said[0] not in phases \
                    and phases & {"forward", "backward"}:
                flags.append(f"contradicts the facts: {sentence.strip()!r} puts {op} in "
                             f"{said[0]}, but the snippet's {op} is in "
                             f"{' / '.join(sorted(phases))} (lines {lines})")
            for clause, inside in clauses:  # the lines a clause cites next to the op
                if not (lines and inside and re.search(pattern, clause, re.I)) or any(
                        a - 1 <= n <= b + 1 for a, b in inside for n in lines):
                    continue
                where = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in inside)
                flags.append(f"contradicts the facts: {sentence.strip()!r} places {op} at "
                             f"line {where}, but the snippet's {op} is at lines {lines}")
        for a, b in cited:
            for line in sorted({a, b}):
                if not first <= line <= last:
                    flags.append(f"cites line {line}, outside the snippet ({first}-{last}): "
                                 f"{sentence.strip()!r}")
    return flags
