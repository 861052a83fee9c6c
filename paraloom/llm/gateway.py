"""Where an OpenAI-compatible API answers: the base URLs ``doctor`` tries and what each says.

A base URL *answers* when ``GET BASE/models`` lists models, or, for a gateway without a model
list, when ``POST BASE/chat/completions`` (or ``/responses``) gives a completion or a JSON error
about the request (an unknown model, a bad field): only an API parses the request. A web page
(the provider's site, a landing page), a 404 and a server error page do not; a 5xx page is kept
apart, because it means the service is failing, not that the URL is wrong.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field

from .provider import PATHS, Provider, http

__all__ = ["Probe", "split_base", "candidates", "probe", "body_for", "is_page", "page_title",
           "models_of"]


@dataclass
class Probe:
    """What one base URL answered. ``via``: the request that showed the API is there."""

    base: str
    answers: bool = False
    via: str = ""
    models: list[str] | None = None
    models_status: int = 0
    model_error: str = ""
    auth: int = 0
    server_error: str = ""
    page: bool = False
    status: int = 0
    wires: dict[str, int] = field(default_factory=dict)


def split_base(base_url: str) -> tuple[str, str]:
    """(base without query and fragment, what was dropped with only its parameter names)."""
    u = urllib.parse.urlsplit(base_url)
    clean = urllib.parse.urlunsplit((u.scheme, u.netloc, u.path.rstrip("/"), "", ""))
    names = [kv.split("=")[0] for kv in u.query.split("&") if kv]
    dropped = ("?" + "&".join(f"{n}=..." for n in names) if names else "") + (
        "#" + u.fragment if u.fragment else "")
    return clean, dropped


def candidates(clean: str) -> list[str]:
    """The path as given, it +/- ``/v1``, then origin + ``/v1``, ``/api``, ``/api/v1``."""
    u = urllib.parse.urlsplit(clean)
    origin = f"{u.scheme}://{u.netloc}"
    out = [clean, clean[:-3] if clean.endswith("/v1") else clean + "/v1"]
    out += [origin + "/v1", origin + "/api", origin + "/api/v1"]
    return list(dict.fromkeys(out))


def is_page(ctype: str, text: str) -> bool:
    return "html" in ctype.lower() or text.lstrip()[:15].lower().startswith(("<!doctype", "<html"))


def page_title(text: str) -> str:
    m = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
    return " ".join(m.group(1).split())[:80] if m else ""


def models_of(text: str) -> list[str] | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None
    return [m.get("id") for m in items if isinstance(m, dict) and m.get("id")]


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _error_message(data) -> str:
    err = data.get("error", data.get("detail", "")) if isinstance(data, dict) else ""
    if isinstance(err, dict):
        code = err.get("code") or err.get("type")
        return f"{err.get('message', '')}{f' ({code})' if code else ''}".strip()
    return str(err)


def _completion(wire: str, data) -> bool:
    if not isinstance(data, dict):
        return False
    return "choices" in data if wire == "chat" else ("output" in data or "output_text" in data)


def body_for(wire: str, model: str) -> dict:
    if wire == "chat":
        return {"model": model, "messages": [{"role": "user", "content": "ping"}],
                "max_tokens": 1}
    return {"model": model, "input": "ping", "max_output_tokens": 16}


def _server_error(status: int, ctype: str, text: str, url: str) -> str:
    title = page_title(text) if is_page(ctype, text) else _error_message(_json(text))[:80]
    return f"HTTP {status}{f' ({title})' if title else ''} from {url}"


def probe(base: str, p: Provider, key: str, timeout: float) -> Probe:
    """Ask ``base`` for its model list, then (without one) for a one-word completion."""
    out = Probe(base)
    url = base + "/models"
    status, ctype, text = http("GET", url, key, timeout=timeout)
    out.status, out.models_status, out.page = status, status, is_page(ctype, text)
    models = models_of(text) if status == 200 else None
    if models is not None:
        out.answers, out.via, out.models = True, f"GET {url} lists {len(models)} models", models
        return out
    if status in (401, 403):
        out.auth, out.via = status, f"GET {url}: HTTP {status}"
        return out
    if status >= 500:
        out.server_error = _server_error(status, ctype, text, url)
    for wire in sorted(PATHS, key=lambda w: w != p.wire_api):
        url = base + PATHS[wire]
        status, ctype, text = http("POST", url, key, body_for(wire, p.model), timeout=timeout)
        out.wires[wire] = status
        data = _json(text)
        if status == 200 and _completion(wire, data):
            out.answers, out.via = True, f"POST {url} answers"
            return out
        if status in (401, 403):
            out.auth, out.via = status, f"POST {url}: HTTP {status}"
            return out
        if status >= 500:
            out.server_error = out.server_error or _server_error(status, ctype, text, url)
            continue
        message = _error_message(data)
        if status in (400, 404, 422) and isinstance(data, dict) and "error" in data \
                and re.search(r"\bmodel", message, re.I):
            out.answers, out.via = True, f"POST {url} answers HTTP {status}"
            out.model_error = message
            return out
        if status in (400, 422) and message:
            out.answers, out.via = True, f"POST {url} answers HTTP {status} ({message[:80]})"
            return out
    return out
