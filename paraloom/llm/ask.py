"""One completion from the configured provider: a system text and a user text in, the answer out.

Generic: the caller (``explain --ask``) writes both texts and judges the answer; this module only
speaks the provider's ``wire_api`` (``chat``: ``/chat/completions``; ``responses``:
``/responses``) and turns every failure into a :class:`~.provider.ProviderError` that says what
to fix (a missing key variable, a rejected key, a wrong path or model id, a failing server).
"""

from __future__ import annotations

import json

from .gateway import is_page, page_title
from .provider import (
    PATHS,
    ConfigError,
    Provider,
    ProviderError,
    http,
    is_placeholder,
    load_provider,
)

__all__ = ["complete", "ask"]


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
        raise ConfigError(f"environment variable {p.env_key} (env_key of provider {p.name!r})"
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


def ask(system: str, user: str, config: str | None = None, env=None,
        timeout: float = 60.0) -> dict:
    """The answer of the provider configured in ``config`` (a Codex ``config.toml``; default
    ``~/.codex/config.toml``): ``{"answer", "provider": {"name", "model", "base_url",
    "wire_api"}}``. Raises :class:`~.provider.ProviderError`."""
    p = load_provider(config, env)
    return {"answer": complete(p, system, user, env, timeout),
            "provider": {"name": p.name, "model": p.model, "base_url": p.base_url,
                         "wire_api": p.wire_api}}
