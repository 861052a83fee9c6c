"""An OpenAI-compatible provider configured like a Codex provider, and one HTTP request to it.

Configuration is read from a Codex ``config.toml`` (default ``~/.codex/config.toml``)::

    model = "gpt-4.1-mini"
    model_provider = "myprovider"

    [model_providers.myprovider]
    base_url = "https://api.example.com/v1"   # the client appends /chat/completions etc.
    env_key = "EXAMPLE_API_KEY"               # the key is read from this variable only
    wire_api = "chat"                         # or "responses"

The key never leaves the process except in the ``Authorization`` header: it is not written to
disk, logged, or put in any message. Every request has ONE deadline for the whole exchange
(connect, headers, body): a server that trickles bytes is cut there, where a socket timeout
alone would wait for ever. Shared by :mod:`.ask` (``explain --ask``) and :mod:`.doctor`;
standard library only (urllib, tomllib; tomli on Python 3.10).
"""

from __future__ import annotations

import http.client as httpclient
import json
import os
import re
import socket
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI (a dependency there, see pyproject.toml)
    import tomli as tomllib

__all__ = ["Provider", "ProviderError", "DeadlineError", "PATHS", "load_provider",
           "config_path", "http", "is_placeholder"]

_DEFAULT = {"openai": {"base_url": "https://api.openai.com/v1", "env_key": "OPENAI_API_KEY",
                       "wire_api": "responses"}}
PATHS = {"chat": "/chat/completions", "responses": "/responses"}
_PLACEHOLDER = re.compile(r"(?<![a-z0-9])your(?![a-z0-9])|placeholder|change[-_ ]?me|"
                          r"replace[-_ ]?me|^<.*>$|^x{4,}$|\.\.\.|^(model|api)[-_ ]?(id|name|key)$"
                          r"|^todo$", re.I)


class ProviderError(RuntimeError):
    """The provider could not be configured or reached, or answered with an error."""


class ConfigError(ProviderError):
    """The setup is wrong before any request (no config file, a missing table or key): the
    user's to fix, not the server's."""


EXAMPLE_CONFIG = """\
model = "gpt-4o-mini"
model_provider = "openai"

[model_providers.openai]
name = "OpenAI"
base_url = "https://api.openai.com/v1"
env_key = "OPENAI_API_KEY"
wire_api = "chat"          # or "responses"
"""
"""A Codex-style ``config.toml`` that ``explain --ask`` and ``doctor`` read (any
OpenAI-compatible server: change base_url, env_key and model)."""


class DeadlineError(ProviderError):
    """The server kept the connection open past the request's deadline (stalled or trickling)."""


def is_placeholder(value: str) -> bool:
    """``YOUR_MODEL_ID``, ``<your key>``, ``changeme``...: text copied from a template."""
    return bool(_PLACEHOLDER.search(value.strip())) or not value.strip()


@dataclass(frozen=True)
class Provider:
    """One ``[model_providers.NAME]`` table with the config's ``model``; the key stays in the
    environment variable ``env_key`` until a request is made."""

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
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None


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
        raise ConfigError(f"no provider config at {p} (write one like a Codex config.toml: "
                            f"model, model_provider, [model_providers.NAME] base_url, env_key, "
                            f"wire_api)")
    cfg = _toml(p)
    name = cfg.get("model_provider", "openai")
    table = {**_DEFAULT, **cfg.get("model_providers", {})}
    if name not in table:
        raise ConfigError(f"model_provider = {name!r} has no [model_providers.{name}] table "
                            f"in {p}; tables present: {sorted(cfg.get('model_providers', {}))}")
    prov = {**_DEFAULT.get(name, {}), **table[name]}
    missing = [k for k in ("base_url", "env_key") if not prov.get(k)]
    missing += [] if cfg.get("model") else ["model"]
    if missing:
        raise ConfigError(f"{p}: missing {', '.join(missing)} for provider {name!r}")
    wire = prov.get("wire_api", "chat")
    if wire not in PATHS:
        raise ConfigError(f"{p}: wire_api = {wire!r} must be 'chat' or 'responses'")
    return Provider(name, cfg["model"], prov["base_url"].rstrip("/"), prov["env_key"], wire, str(p))


class _Watch:
    """Shuts the request's sockets at the deadline, which unblocks any read in progress."""

    def __init__(self, timeout: float):
        self.lock, self.socks, self.expired = threading.Lock(), [], False
        self.timer = threading.Timer(timeout, self.cut)
        self.timer.daemon = True

    def attach(self, sock) -> None:
        with self.lock:
            self.socks.append(sock)
            if self.expired:  # connected just after the deadline
                _shut(sock)

    def cut(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.socks:
                _shut(sock)


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _WatchedHTTP(httpclient.HTTPConnection):
    watch: _Watch

    def connect(self):
        super().connect()
        self.watch.attach(self.sock)


class _WatchedHTTPS(httpclient.HTTPSConnection):
    watch: _Watch

    def connect(self):
        super().connect()
        self.watch.attach(self.sock)


def _factory(cls, watch: _Watch):
    def make(*args, **kwargs):
        conn = cls(*args, **kwargs)
        conn.watch = watch
        return conn
    return make


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def http_open(self, req):
        return self.do_open(_factory(_WatchedHTTP, self.watch), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def https_open(self, req):
        extra = {} if getattr(self, "_check_hostname", None) is None else {
            "check_hostname": self._check_hostname}  # Python < 3.12 only
        return self.do_open(_factory(_WatchedHTTPS, self.watch), req, context=self._context,
                            **extra)


def http(method: str, url: str, key: str | None, body: dict | None = None,
         timeout: float = 30.0) -> tuple[int, str, str]:
    """(status, content type, text) of one request that ends within ``timeout`` seconds in all
    (``DeadlineError`` otherwise); never raises on an HTTP error status. Proxies as urllib."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Accept", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    watch = _Watch(timeout)
    opener = urllib.request.build_opener(_HTTPHandler(watch), _HTTPSHandler(watch))
    box: dict = {}

    def request() -> None:  # in a worker: the name lookup cannot be cut, the wait for it can
        try:
            try:
                with opener.open(req, timeout=timeout) as resp:
                    box["out"] = (resp.status, resp.headers.get("Content-Type", ""),
                                  resp.read())
            except urllib.error.HTTPError as err:
                box["out"] = err.code, err.headers.get("Content-Type", ""), err.read()
        except BaseException as err:  # handed to the caller below
            box["err"] = err
    watch.timer.start()
    worker = threading.Thread(target=request, daemon=True, name="paraloom-http")
    worker.start()
    worker.join(timeout + 1.0)
    try:
        if worker.is_alive():  # stuck before a socket existed: the name lookup, a proxy
            watch.cut()
            raise DeadlineError(f"no answer from {url} within {timeout:g} s (the host name "
                                f"lookup or the connection did not finish)")
        if "err" in box:
            raise box["err"]
        out = box["out"]
        if watch.expired:
            raise httpclient.IncompleteRead(out[2])
        return out[0], out[1], out[2].decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, httpclient.HTTPException) as err:
        if watch.expired:
            raise DeadlineError(f"no complete answer from {url} within {timeout:g} s (the "
                                f"server kept the connection open: stalled or trickling "
                                f"bytes)") from None
        raise ProviderError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from None
    finally:
        watch.timer.cancel()
