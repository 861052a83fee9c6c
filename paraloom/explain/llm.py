"""An OpenAI-compatible provider configured like a Codex provider, and ``explain --ask``.

Configuration is read from a Codex ``config.toml`` (default ``~/.codex/config.toml``)::

    model = "gpt-4.1-mini"
    model_provider = "myprovider"

    [model_providers.myprovider]
    base_url = "https://api.example.com/v1"   # the client appends /chat/completions etc.
    env_key = "EXAMPLE_API_KEY"               # the key is read from this variable only
    wire_api = "chat"                         # or "responses"

The key never leaves the process except in the ``Authorization`` header: it is not written to
disk, logged, or put in any message. Standard library only (urllib, tomllib; tomli on Python 3.10).
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Provider", "ProviderError", "load_provider", "http", "complete", "ask",
           "contradictions", "doctor_main"]

_DEFAULT = {"openai": {"base_url": "https://api.openai.com/v1", "env_key": "OPENAI_API_KEY",
                       "wire_api": "responses"}}
_PATHS = {"chat": "/chat/completions", "responses": "/responses"}
_SYSTEM = ("You explain Megatron-style parallel-training code. Answer only from the numbered "
           "code and the extracted facts below; cite line numbers; say 'needs more context' "
           "when the code shown does not decide the question. Do not invent code.")


class ProviderError(RuntimeError):
    """The provider could not be configured or reached, or answered with an error."""


@dataclass(frozen=True)
class Provider:
    name: str
    model: str
    base_url: str
    env_key: str
    wire_api: str
    config: str

    def key(self, env=None) -> str | None:
        value = (os.environ if env is None else env).get(self.env_key)
        return value or None


def _toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser from PyPI (a dependency there, see pyproject.toml)
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ProviderError(f"cannot read {path}: {err}") from None


def config_path(path: str | None = None, env=None) -> Path:
    env = os.environ if env is None else env
    if path:
        return Path(path)
    home = env.get("CODEX_HOME") or str(Path(env.get("HOME", "~")) / ".codex")
    return Path(home).expanduser() / "config.toml"


def load_provider(path: str | None = None, env=None) -> Provider:
    """The provider of ``model_provider`` in the Codex config at ``path``."""
    p = config_path(path, env)
    if not p.is_file():
        raise ProviderError(f"no provider config at {p} (write one like a Codex config.toml: "
                            f"model, model_provider, [model_providers.NAME] base_url, env_key, "
                            f"wire_api)")
    cfg = _toml(p)
    name = cfg.get("model_provider", "openai")
    table = {**_DEFAULT, **cfg.get("model_providers", {})}
    if name not in table:
        raise ProviderError(f"model_provider = {name!r} has no [model_providers.{name}] table "
                            f"in {p}; tables present: {sorted(cfg.get('model_providers', {}))}")
    prov = {**_DEFAULT.get(name, {}), **table[name]}
    missing = [k for k in ("base_url", "env_key") if not prov.get(k)]
    missing += [] if cfg.get("model") else ["model"]
    if missing:
        raise ProviderError(f"{p}: missing {', '.join(missing)} for provider {name!r}")
    wire = prov.get("wire_api", "chat")
    if wire not in _PATHS:
        raise ProviderError(f"{p}: wire_api = {wire!r} must be 'chat' or 'responses'")
    return Provider(name, cfg["model"], prov["base_url"].rstrip("/"), prov["env_key"], wire, str(p))


def http(method: str, url: str, key: str | None, body: dict | None = None,
         timeout: float = 30.0) -> tuple[int, str, str]:
    """(status, content type, text) of one request; never raises on an HTTP error status."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Accept", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode(
                "utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as err:
        raise ProviderError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from None


def _error_text(text: str) -> str:
    try:
        err = json.loads(text).get("error", {})
        return err.get("message", "") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:200]


def complete(p: Provider, system: str, user: str, env=None, timeout: float = 60.0) -> str:
    """One answer from the provider, over its ``wire_api``."""
    key = p.key(env)
    if key is None:
        raise ProviderError(f"environment variable {p.env_key} (env_key of provider {p.name!r})"
                            f" is missing or empty: export {p.env_key}=<your key>")
    if p.wire_api == "chat":
        body = {"model": p.model, "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": user}]}
    else:
        body = {"model": p.model, "instructions": system, "input": user}
    status, _, text = http("POST", p.base_url + _PATHS[p.wire_api], key, body, timeout)
    if status != 200:
        hint = {401: f"the key in {p.env_key} was rejected",
                404: "wrong base_url path, wire_api or model id"}.get(status, "")
        raise ProviderError(f"HTTP {status} from {p.base_url + _PATHS[p.wire_api]}"
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
        raise ProviderError(f"unexpected {p.wire_api} reply: {text[:200]}") from None


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
        "reduce_scatter": r"reduce[-_ ]?scatter"}
_PHASE_WORDS = {"forward": r"\bforward\b|前向", "backward": r"\bbackward\b|反向"}


def contradictions(answer: str, facts: dict) -> list[str]:
    """Sentences of ``answer`` that contradict a fact: an op placed in a phase where the snippet
    has none of it (while it has that op elsewhere), or a cited line outside the snippet."""
    flags = []
    first, last = facts["lines"]
    for sentence in re.split(r"(?<=[.!?。！？])\s*|\n+", answer):
        for op, pattern in _OPS.items():
            if not re.search(pattern, sentence, re.IGNORECASE):
                continue
            phases = {s["phase"] for s in facts["sites"] if s["op"] == op}
            said = [ph for ph, w in _PHASE_WORDS.items() if re.search(w, sentence, re.I)]
            if len(said) == 1 and phases and said[0] not in phases \
                    and phases & {"forward", "backward"}:
                lines = sorted({s["line"] for s in facts["sites"] if s["op"] == op})
                flags.append(f"contradicts the facts: {sentence.strip()!r} puts {op} in "
                             f"{said[0]}, but the snippet's {op} is in "
                             f"{' / '.join(sorted(phases))} (lines {lines})")
        for n in re.findall(r"\blines?\s+(\d+)|第\s*(\d+)\s*行", sentence):
            line = int(n[0] or n[1])
            if not first <= line <= last:
                flags.append(f"cites line {line}, outside the snippet ({first}-{last}): "
                             f"{sentence.strip()!r}")
    return flags


def ask(question: str, snippet, facts: dict, config: str | None = None, lang: str = "en",
        env=None) -> dict:
    """The provider's answer to ``question`` about ``snippet``, with the contradiction flags."""
    p = load_provider(config, env)
    user = (f"Question: {question}\n\nCode ({snippet.name}, lines {snippet.first}-"
            f"{snippet.last}):\n{snippet.numbered()}\n\nExtracted facts (JSON):\n"
            f"{_facts_brief(facts)}\n\nAnswer in {'Chinese' if lang == 'zh' else 'English'}.")
    answer = complete(p, _SYSTEM, user, env)
    return {"answer": answer, "flags": contradictions(answer, facts),
            "provider": {"name": p.name, "model": p.model, "base_url": p.base_url,
                         "wire_api": p.wire_api}}


def doctor_main(argv: list[str] | None = None) -> int:
    from .doctor import doctor_main as main
    return main(argv)
