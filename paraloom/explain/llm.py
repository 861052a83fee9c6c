"""``explain --ask``: the provider's answer about a snippet, checked against the facts.

The provider, its configuration (a Codex ``config.toml``) and the HTTP request live in
``provider`` (shared with ``doctor``); this module builds the question from the numbered code and
the extracted facts, and flags the sentences of the answer that contradict those facts.
"""

from __future__ import annotations

import json
import re

from .gateway import is_page, page_title
from .provider import PATHS, Provider, ProviderError, http, is_placeholder, load_provider

__all__ = ["Provider", "ProviderError", "load_provider", "http", "complete", "ask",
           "contradictions"]

_SYSTEM = ("You explain Megatron-style parallel-training code. Answer only from the numbered "
           "code and the extracted facts below; cite line numbers; say 'needs more context' "
           "when the code shown does not decide the question. Do not invent code.")


def _error_text(text: str) -> str:
    if is_page("", text):
        return f"a web page: {page_title(text) or text.strip()[:80]}"
    try:
        err = json.loads(text).get("error", {})
        return err.get("message", "") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:200]


def complete(p: Provider, system: str, user: str, env=None, timeout: float = 60.0) -> str:
    """One answer from the provider, over its ``wire_api``."""
    key = p.key(env)
    if key is None or is_placeholder(key):
        state = "missing or empty" if key is None else "a placeholder"
        raise ProviderError(f"environment variable {p.env_key} (env_key of provider {p.name!r})"
                            f" is {state}: export {p.env_key}=<your key>")
    if p.wire_api == "chat":
        body = {"model": p.model, "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": user}]}
    else:
        body = {"model": p.model, "instructions": system, "input": user}
    status, _, text = http("POST", p.base_url + PATHS[p.wire_api], key, body, timeout)
    if status != 200:
        hint = {401: f"the key in {p.env_key} was rejected",
                404: f"model = {p.model!r} is a placeholder" if is_placeholder(p.model)
                else "wrong base_url path, wire_api or model id"}.get(status, "")
        if status >= 500:
            hint = "the server failed (not a wrong URL): retry later"
        raise ProviderError(f"HTTP {status} from {p.base_url + PATHS[p.wire_api]}"
                            f"{': ' + hint if hint else ''} ({_error_text(text)})")
    try:
        data = json.loads(text)
        if p.wire_api == "chat":
            return data["choices"][0]["message"]["content"]
        if data.get("output_text"):
            return data["output_text"]
        return "".join(c.get("text", "") for item in data.get("output", [])
                       for c in item.get("content", []) or [] if isinstance(c, dict))
    except (ValueError, KeyError, IndexError, TypeError):
        site = " (base_url is a web site, not the API)" if is_page("", text) else ""
        raise ProviderError(f"unexpected {p.wire_api} reply: {_error_text(text)[:200]}{site}"
                            ) from None


def _facts_brief(facts: dict) -> str:
    keep = {"sites": ["line", "class", "function", "phase", "op", "kind", "async", "condition",
                      "via"],
            "partitions": ["line", "what", "parts", "into"],
            "world_sizes": ["line", "name", "source", "group"],
            "weights": ["line", "name", "shape", "partition_dim", "layout"]}
    brief = {k: [{f: x.get(f) for f in fields} for x in facts[k]] for k, fields in keep.items()}
    brief["answers"] = {k: v["text"] for k, v in facts["answers"].items()}
    return json.dumps(brief, ensure_ascii=False)


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


def ask(question: str, snippet, facts: dict, config: str | None = None, lang: str = "en",
        env=None, timeout: float = 60.0) -> dict:
    """The provider's answer to ``question`` about ``snippet``, with the contradiction flags."""
    p = load_provider(config, env)
    user = (f"Question: {question}\n\nCode ({snippet.name}, lines {snippet.first}-"
            f"{snippet.last}):\n{snippet.numbered()}\n\nExtracted facts (JSON):\n"
            f"{_facts_brief(facts)}\n\nAnswer in {'Chinese' if lang == 'zh' else 'English'}.")
    answer = complete(p, _SYSTEM, user, env, timeout)
    return {"answer": answer, "flags": contradictions(answer, facts),
            "provider": {"name": p.name, "model": p.model, "base_url": p.base_url,
                         "wire_api": p.wire_api}}
