"""Why the provider in config.toml does not answer, and the fix: :func:`diagnose`, the findings
``paraloom doctor`` prints.

Checks, in order: the config and its provider table; the key variable named by ``env_key``
(missing, empty or a template placeholder: nothing is sent then); the base URL (a query string
or fragment is dropped; the path as given, it +/- ``/v1``, origin + ``/v1``, ``/api``,
``/api/v1`` are tried and the one that answers is named; a gateway without ``GET /models`` is
recognised by its chat or responses endpoint; a 5xx page or a stalled answer is the server's
failure, not a wrong URL); the model id against the served list (a placeholder gets the whole
list); and the ``wire_api`` by a one-word request on both protocols. Each request has one
deadline (``--timeout``). The key is sent only in the Authorization header and never printed.
"""

from __future__ import annotations

import difflib
import re
import textwrap
import urllib.parse

from .gateway import Probe, body_for, candidates, probe, split_base
from .provider import (
    EXAMPLE_CONFIG,
    PATHS,
    DeadlineError,
    Provider,
    ProviderError,
    config_path,
    http,
    is_placeholder,
    load_provider,
)

__all__ = ["diagnose"]


def _where(p: Provider) -> str:
    return f"in [model_providers.{p.name}] of {p.config}"


def _why(clean: str, cand: str) -> str:
    if clean.endswith("/v1") and cand == clean[:-3]:
        return "base_url ends in an extra /v1: the API lives one level up"
    if cand == clean + "/v1":
        return "base_url lacks the API path /v1"
    return f"the API is not at {clean}"  # e.g. a gateway under /api


def _static_base(p: Provider, found: list[dict]) -> bool:
    """False after recording a base_url that needs no request to be wrong."""
    if not p.base_url.lower().startswith(("http://", "https://")):
        local = p.base_url.startswith(("localhost", "127.", "[::1]"))
        found.append(dict(check="base_url", ok=False,
                          problem=f"base_url {p.base_url} has no http:// or https:// scheme",
                          fix=f'set base_url = "{"http" if local else "https"}://'
                              f'{p.base_url}" {_where(p)}'))
        return False
    host = urllib.parse.urlsplit(p.base_url).hostname or ""
    if is_placeholder(host) or re.search(r"(^|\.)example\.(com|org|net)$", host):
        found.append(dict(check="base_url", ok=False,
                          problem=f"base_url {p.base_url} holds a placeholder host from a "
                                  f"template ({host}); nothing was sent",
                          fix=f"set base_url to the API URL in your provider's docs "
                              f"{_where(p)}"))
        return False
    return True


def _find_base(p: Provider, key: str, timeout: float, found: list[dict]) -> Probe | None:
    """The probe of the base URL that answers (recording what is wrong), or None."""
    if not _static_base(p, found):
        return None
    clean, dropped = split_base(p.base_url)
    first = probe(clean, p, key, timeout)
    if first.auth:
        found.append(dict(check="key", ok=False,
                          problem=f"HTTP {first.auth}: the endpoint rejected the key in "
                                  f"{p.env_key} ({first.via})",
                          fix=f"export a valid key: export {p.env_key}=<key for {clean}>"))
        return None
    tried = [first]
    ans = first if first.answers else None
    for cand in candidates(clean)[1:] if ans is None else []:
        tried.append(probe(cand, p, key, timeout))
        if tried[-1].answers or tried[-1].auth:
            ans = tried[-1]
            break
    failing = next((pr for pr in tried if pr.server_error), None)
    if ans is None and failing is not None:
        at = "base_url" if failing is first else f"{failing.base} (not base_url as written)"
        found.append(dict(check="server", ok=False,
                          problem=f"{failing.server_error}: the server's own error page, so "
                                  f"the service at {at} is failing; that is not a wrong URL",
                          fix="retry later; if it persists, ask the provider (status page, "
                              "support); rerun paraloom doctor once it answers"))
        return None
    if ans is None:
        tried = ", ".join(candidates(clean))
        what = (f"base_url {p.base_url} is a web page, not an OpenAI-compatible API"
                if first.page else f"HTTP {first.status} from {clean}/models")
        found.append(dict(check="base_url", ok=False,
                          problem=f"{what}; none of these answers as an API: {tried}",
                          fix="use the provider's API base URL from its docs (the client "
                              "appends /chat/completions, /responses, /models), not its web "
                              "site"))
        return None
    if ans is first and not dropped:
        found.append(dict(check="base_url", ok=True, detail=_answer_detail(ans)))
        return ans
    why = [f"base_url carries {dropped} (a link's query or fragment: the client would put "
           f"/models after it)"] if dropped else []
    if ans is not first:
        why.append(_why(clean, ans.base) + (f" ({clean} answers with a web page, HTTP "
                                             f"{first.status})" if first.page else
                                             f" (HTTP {first.status})"))
    found.append(dict(check="base_url", ok=False,
                      problem=f"{'; '.join(why)}; the API answers at {ans.base}: {ans.via}",
                      fix=f'set base_url = "{ans.base}" {_where(p)}'))
    if ans.auth:
        found.append(dict(check="key", ok=False,
                          problem=f"HTTP {ans.auth}: {ans.base} rejected the key in "
                                  f"{p.env_key}",
                          fix=f"export a valid key: export {p.env_key}=<key for {ans.base}>"))
        return None
    return ans


def _answer_detail(ans: Probe) -> str:
    if ans.models is not None:
        return ans.via
    return f"{ans.via} (no model list: GET {ans.base}/models gives HTTP {ans.models_status})"


def _check_model(p: Provider, ans: Probe, found: list[dict]) -> bool:
    served, ph = ans.models, is_placeholder(p.model)
    what = f"model {p.model!r}" + (" is a placeholder from a template, not a model id"
                                   if ph else "")
    if served is None:
        if not ans.model_error:
            found.append(dict(check="model", ok=True, detail=f"{p.model!r} answers"))
            return True
        found.append(dict(check="model", ok=False,
                          problem=f"{what}; the endpoint says: {ans.model_error} (it publishes "
                                  f"no model list: GET {ans.base}/models gives HTTP "
                                  f"{ans.models_status})",
                          fix=f'set model = "<an id from the provider\'s model list>" '
                              f"in {p.config}"))
        return False
    if p.model in served and not ph:
        found.append(dict(check="model", ok=True, detail=f"{p.model!r} is served"))
        return True
    close = [] if ph else difflib.get_close_matches(p.model, served, n=3, cutoff=0.6)
    listed = ", ".join(f'"{m}"' for m in served[:30]) + (" ..." if len(served) > 30 else "")
    if close:
        fix = f'set model = "{close[0]}" in {p.config} (close: {", ".join(close)})'
    elif served:
        fix = f'set model = "ID" in {p.config}, ID one of the {len(served)} served: {listed}'
    else:
        fix = "the endpoint lists no models: ask the provider which ids it serves"
    found.append(dict(check="model", ok=False,
                      problem=f"{what}" + ("" if ph else " is not in the endpoint's model "
                                           f"list ({len(served)} models)"), fix=fix))
    return False


def _check_wire(p: Provider, base: str, key: str, timeout: float, found: list[dict]) -> None:
    answers = {wire: http("POST", base + path, key, body_for(wire, p.model), timeout)[0]
               for wire, path in PATHS.items()}
    if answers[p.wire_api] == 200:
        found.append(dict(check="wire_api", ok=True, detail=f"{p.wire_api} answers"))
        return
    other = next(w for w in PATHS if w != p.wire_api)
    if answers[other] == 200:
        found.append(dict(check="wire_api", ok=False,
                          problem=f"wire_api = {p.wire_api!r} but {base}{PATHS[p.wire_api]} "
                                  f"answers HTTP {answers[p.wire_api]}; the endpoint speaks "
                                  f"{other!r}",
                          fix=f'set wire_api = "{other}" {_where(p)}'))
    else:
        found.append(dict(check="wire_api", ok=False,
                          problem=f"neither protocol answers (chat: HTTP {answers['chat']}, "
                                  f"responses: HTTP {answers['responses']})",
                          fix="check base_url and the model id above"))


def _check_key(p: Provider, env, found: list[dict]) -> str | None:
    key = p.key(env)
    if key is None or is_placeholder(key):
        state = "missing or empty" if key is None else "a placeholder (value not shown)"
        found.append(dict(check="key", ok=False,
                          problem=f"environment variable {p.env_key} (env_key) is {state}: "
                                  f"every request would get HTTP 401, so none was sent",
                          fix=f"export {p.env_key}=<your key> (in the shell that runs paraloom)"))
        return None
    found.append(dict(check="key", ok=True, detail=f"{p.env_key} is set"))
    return key


def diagnose(config: str | None = None, env=None, timeout: float = 15.0) -> list[dict]:
    """Findings in check order: dicts with ``check``, ``ok`` and either ``detail`` or
    ``problem`` + ``fix``; the checks after a blocking problem are not run."""
    found: list[dict] = []
    try:
        p = load_provider(config, env)
    except ProviderError as err:
        return [dict(check="config", ok=False, problem=str(err),
                     fix=f"write {config_path(config, env)} like this (any OpenAI-compatible "
                         f"server: change base_url, env_key and model):\n"
                         + textwrap.indent(EXAMPLE_CONFIG, "           "))]
    found.append(dict(check="config", ok=True, detail=f"{p.config}: provider {p.name!r}, model "
                      f"{p.model!r}, base_url {p.base_url}, wire_api {p.wire_api}"))
    key = _check_key(p, env, found)
    if key is None:
        return found
    try:
        ans = _find_base(p, key, timeout, found)
        if ans is not None and _check_model(p, ans, found):
            _check_wire(p, ans.base, key, timeout, found)
    except DeadlineError as err:
        found.append(dict(check="server", ok=False, problem=str(err),
                          fix="retry later; a slow gateway may need more time: "
                              "paraloom doctor --timeout 60"))
    except ProviderError as err:
        found.append(dict(check="base_url", ok=False, problem=str(err),
                          fix="check the host and port of base_url and your network"))
    return _scrub(found, key)


def _scrub(found: list[dict], key: str) -> list[dict]:
    """The key never appears in a finding, even if a server echoes it back."""
    return [{k: v.replace(key, "***") if isinstance(v, str) else v for k, v in f.items()}
            for f in found]

