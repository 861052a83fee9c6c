"""``paraloom doctor``: why the provider in config.toml does not answer, and the fix.

Checks, in order: the config and its provider table; the key variable named by ``env_key``
(missing or empty: the usual 401); the base URL (a web page, a missing ``/v1``, or an extra one:
the usual 404) by asking for the model list; the model id against that list; and the
``wire_api`` by a one-word request on both protocols. The key is sent only in the Authorization
header and never printed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys

from .llm import _PATHS, Provider, ProviderError, http, load_provider

__all__ = ["diagnose", "doctor_main"]


def _models(text: str) -> list[str] | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None
    return [m.get("id") for m in items if isinstance(m, dict) and m.get("id")]


def _is_page(ctype: str, text: str) -> bool:
    return "html" in ctype.lower() or text.lstrip()[:15].lower().startswith(("<!doctype", "<html"))


def _base_candidates(base: str) -> list[str]:
    out = []
    if base.endswith("/v1"):
        out.append(base[:-3])
    out.append(base + "/v1")
    return out


def _check_base(p: Provider, key: str | None, found: list[dict]) -> list[str] | None:
    """The model list, or None after recording what is wrong with base_url."""
    status, ctype, text = http("GET", p.base_url + "/models", key, timeout=15)
    models = _models(text) if status == 200 else None
    if models is not None:
        found.append(dict(check="base_url", ok=True, detail=f"{p.base_url}/models lists "
                          f"{len(models)} models"))
        return models
    if status in (401, 403):
        found.append(dict(check="key", ok=False,
                          problem=f"HTTP {status}: the endpoint rejected the key in "
                                  f"{p.env_key}",
                          fix=f"export a valid key: export {p.env_key}=<key for {p.base_url}>"))
        return None
    _, _, root_text = http("GET", p.base_url, key, timeout=15)
    page = _is_page(ctype, text) or _is_page("", root_text)
    for cand in _base_candidates(p.base_url):
        try:
            s2, _, t2 = http("GET", cand + "/models", key, timeout=15)
        except ProviderError:
            continue
        if s2 == 200 and _models(t2) is not None:
            extra = p.base_url.endswith("/v1") and cand == p.base_url[:-3]
            why = ("base_url ends in an extra /v1: the API lives one level up"
                   if extra else "base_url lacks the API path /v1")
            found.append(dict(check="base_url", ok=False,
                              problem=f"HTTP {status} from {p.base_url}/models ({why}"
                                      f"{'; base_url is a web page' if page else ''})",
                              fix=f'set base_url = "{cand}" in [model_providers.{p.name}] '
                                  f"of {p.config}"))
            return _models(t2)
    problem = (f"base_url {p.base_url} is a web page, not an OpenAI-compatible API" if page
               else f"HTTP {status} from {p.base_url}/models and no /v1 variant answers")
    found.append(dict(check="base_url", ok=False, problem=problem,
                      fix="use the provider's API base URL (usually ending in /v1), not its "
                          "web site; the client appends /chat/completions, /responses, /models"))
    return None


def _check_wire(p: Provider, key: str, found: list[dict]) -> None:
    answers = {}
    for wire, path in _PATHS.items():
        body = ({"model": p.model, "messages": [{"role": "user", "content": "ping"}],
                 "max_tokens": 1} if wire == "chat"
                else {"model": p.model, "input": "ping", "max_output_tokens": 16})
        answers[wire] = http("POST", p.base_url + path, key, body, timeout=30)[0]
    if answers[p.wire_api] == 200:
        found.append(dict(check="wire_api", ok=True, detail=f"{p.wire_api} answers"))
        return
    other = next(w for w in _PATHS if w != p.wire_api)
    if answers[other] == 200:
        found.append(dict(check="wire_api", ok=False,
                          problem=f"wire_api = {p.wire_api!r} but {p.base_url}"
                                  f"{_PATHS[p.wire_api]} answers HTTP {answers[p.wire_api]}; "
                                  f"the endpoint speaks {other!r}",
                          fix=f'set wire_api = "{other}" in [model_providers.{p.name}]'))
    else:
        found.append(dict(check="wire_api", ok=False,
                          problem=f"neither protocol answers (chat: HTTP {answers['chat']}, "
                                  f"responses: HTTP {answers['responses']})",
                          fix="check base_url and the model id above"))


def diagnose(config: str | None = None, env=None) -> list[dict]:
    """Findings: dicts with ``check``, ``ok`` and either ``detail`` or ``problem`` + ``fix``."""
    found: list[dict] = []
    try:
        p = load_provider(config, env)
    except ProviderError as err:
        return [dict(check="config", ok=False, problem=str(err),
                     fix="write the provider table, see `paraloom explain --help`")]
    found.append(dict(check="config", ok=True, detail=f"{p.config}: provider {p.name!r}, model "
                      f"{p.model!r}, base_url {p.base_url}, wire_api {p.wire_api}"))
    key = p.key(env)
    if key is None:
        found.append(dict(check="key", ok=False,
                          problem=f"environment variable {p.env_key} (env_key) is missing or "
                                  f"empty: every request would get HTTP 401",
                          fix=f"export {p.env_key}=<your key> (in the shell that runs paraloom)"))
    else:
        found.append(dict(check="key", ok=True, detail=f"{p.env_key} is set"))
    try:
        models = _check_base(p, key, found)
    except ProviderError as err:
        found.append(dict(check="base_url", ok=False, problem=str(err),
                          fix="check the host and port of base_url and your network"))
        return found
    if models is None:
        return found
    if p.model not in models:
        close = difflib.get_close_matches(p.model, models, n=3, cutoff=0.3)
        found.append(dict(check="model", ok=False,
                          problem=f"model {p.model!r} is not in the endpoint's model list "
                                  f"({len(models)} models)",
                          fix=f'set model = "{close[0] if close else models[0]}" '
                              f"(close: {close or models[:3]})" if models
                          else "the endpoint lists no models"))
        return found
    found.append(dict(check="model", ok=True, detail=f"{p.model!r} is served"))
    if key is not None:
        _check_wire(p, key, found)
    return found


def doctor_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="Codex-style config.toml (default ~/.codex/config.toml)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    found = diagnose(args.config)
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for f in found:
            if f["ok"]:
                print(f"ok       {f['check']}: {f['detail']}")
            else:
                print(f"PROBLEM  {f['check']}: {f['problem']}\n         fix: {f['fix']}")
    return 0 if all(f["ok"] for f in found) else 1


if __name__ == "__main__":
    sys.exit(doctor_main())
