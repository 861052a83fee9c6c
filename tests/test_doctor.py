"""``paraloom doctor`` against a fake gateway on 127.0.0.1 that serves the OpenAI-compatible API
under ``/api`` (not ``/v1``), with switches for the usual gateway-setup mistakes: no ``GET
/models``, a 502 HTML page, several models, a server that trickles bytes, and a landing page.
Every case asserts that following the printed ``fix:`` makes doctor pass."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from paraloom.commands.doctor import main as doctor_main
from paraloom.commands.explain import main as explain_main
from paraloom.llm import ProviderError, complete, diagnose, load_provider

KEY = "sk-gateway-secret-42"
MODELS = ["alpha-7b", "beta-13b", "gamma-70b"]
LANDING = "<!doctype html><html><head><title>Acme AI</title></head><body>Try it!</body></html>"
BAD_GATEWAY = ("<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad "
               "Gateway</h1></center><hr><center>nginx</center></body></html>")


class _Gateway(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _trickle(self):
        """One byte every 50 ms of a body (or, ``trickle == "headers"``, of a header) that never
        completes."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.server.trickle == "headers":
            self.flush_headers()
            self.wfile.write(b"X-Padding: ")
        else:
            self.send_header("Content-Length", "100000")
            self.end_headers()
        end = time.monotonic() + 20
        try:
            while time.monotonic() < end and not self.server.stopping:
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def _route(self, body):
        srv = self.server
        path = self.path.split("?")[0].split("#")[0]
        srv.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        if not path.startswith("/api/"):
            if srv.landing:
                return self._send(200, LANDING, "text/html; charset=utf-8")
            return self._send(404, "<!doctype html><html><title>Not found</title></html>",
                              "text/html")
        if srv.fail:
            return self._send(srv.fail, BAD_GATEWAY, "text/html")
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": {"message": "invalid api key"}})
        if srv.trickle:
            return self._trickle()
        if path == "/api/models" and self.command == "GET" and not srv.no_models:
            return self._send(200, {"object": "list", "data": [{"id": m} for m in srv.models]})
        wire = {"/api/chat/completions": "chat", "/api/responses": "responses"}.get(path)
        if wire is None or wire not in srv.wires or self.command != "POST":
            return self._send(404, {"detail": "Not Found"})
        if body.get("model") not in srv.models:
            return self._send(404, {"error": {"message": f"model {body.get('model')} does not "
                                                         "exist", "code": "model_not_found"}})
        if wire == "chat":
            return self._send(200, {"choices": [{"message": {"content": "pong"}}]})
        return self._send(200, {"output": [{"content": [{"text": "pong"}]}]})

    def do_GET(self):
        self._route({})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        self._route(json.loads(self.rfile.read(n) or b"{}"))


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture()
def gw():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    srv.daemon_threads = True
    srv.seen, srv.models, srv.wires = [], list(MODELS), {"chat", "responses"}
    srv.no_models = srv.trickle = srv.landing = srv.stopping = False
    srv.fail = 0
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    stop = threading.Timer(60, srv.shutdown)  # bounded: stops by itself
    stop.daemon = True
    stop.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.stopping = True
    stop.cancel()
    srv.shutdown()
    srv.server_close()
    thread.join(5)


ENV = {"GW_KEY": KEY}


def _config(path, base_url, model="alpha-7b", wire="chat"):
    path.write_text(f'model = "{model}"\nmodel_provider = "gw"\n\n[model_providers.gw]\n'
                    f'base_url = "{base_url}"\nenv_key = "GW_KEY"\nwire_api = "{wire}"\n')
    return str(path)


def _problems(found):
    return [f for f in found if not f["ok"]]


def _follow(fix: str, cfg: str, env: dict) -> None:
    """Do what a user does with the printed fix: paste the ``key = "value"`` into the config
    (for a list of choices, the last one offered) or export the variable."""
    m = re.search(r"export (\w+)=", fix)
    if m:
        env[m.group(1)] = KEY
        return
    m = re.search(r'set (\w+) = "([^"]*)"', fix)
    assert m, fix
    field, value = m.groups()
    choices = re.findall(r'"([^"]+)"', fix.split("one of", 1)[1]) if "one of" in fix else []
    value = choices[-1] if choices else value
    text = open(cfg).read()
    assert re.search(rf"^{field} = ", text, re.M), (field, text)
    with open(cfg, "w") as f:
        f.write(re.sub(rf'^{field} = "[^"]*"', f'{field} = "{value}"', text, flags=re.M))


def _fixed(cfg, env, timeout=5.0, steps=3):
    """Follow the first fix until doctor passes (at most ``steps`` fixes)."""
    for _ in range(steps + 1):
        found = diagnose(cfg, env, timeout=timeout)
        bad = _problems(found)
        if not bad:
            return found
        _follow(bad[0]["fix"], cfg, env)
    raise AssertionError(f"still failing after {steps} fixes: {found}")


def test_healthy_gateway_passes(gw, tmp_path):
    found = diagnose(_config(tmp_path / "c.toml", gw.url + "/api"), dict(ENV))
    assert all(f["ok"] for f in found), found
    assert [f["check"] for f in found] == ["config", "key", "base_url", "model", "wire_api"]


@pytest.mark.parametrize("given", ["", "/v1", "/api/v1"])
def test_base_url_without_api_path_names_the_url_that_answers(gw, tmp_path, given):
    cfg = _config(tmp_path / "c.toml", gw.url + given)
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert [f["check"] for f in bad] == ["base_url"], bad
    assert f'base_url = "{gw.url}/api"' in bad[0]["fix"]
    assert f"{gw.url}/api/models" in bad[0]["problem"]  # the URL that answered
    assert "no /v1 variant answers" not in bad[0]["problem"]
    assert len(bad[0]["fix"].split("\n")) == 1
    _fixed(cfg, dict(ENV), steps=1)


def test_landing_page_with_utm_query_is_stripped_and_probed(gw, tmp_path):
    gw.landing = True
    cfg = _config(tmp_path / "c.toml", gw.url + "/?utm_source=newsletter&utm_medium=mail#top")
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert [f["check"] for f in bad] == ["base_url"], bad
    assert "utm_source" in bad[0]["problem"] and "web page" in bad[0]["problem"]
    assert f'base_url = "{gw.url}/api"' in bad[0]["fix"]
    assert all("utm_source" not in path for _, path, _, _ in gw.seen)  # the query was stripped
    _fixed(cfg, dict(ENV), steps=1)


def test_gateway_without_models_endpoint(gw, tmp_path, monkeypatch, capsys):
    gw.no_models = True
    good = _config(tmp_path / "good.toml", gw.url + "/api")
    found = diagnose(good, dict(ENV))
    assert all(f["ok"] for f in found), found
    base = next(f for f in found if f["check"] == "base_url")
    assert f"{gw.url}/api/chat/completions" in base["detail"]
    # the same config works for explain --ask, and doctor agrees (exit 0)
    src = tmp_path / "f.py"
    src.write_text("import torch.distributed as dist\n\ndef f(t):\n    dist.all_reduce(t)\n")
    monkeypatch.setenv("GW_KEY", KEY)
    assert doctor_main(["--config", good]) == 0
    assert explain_main(["--ask", "what?", str(src), "--config", good]) == 0
    assert "pong" in capsys.readouterr().out
    # a wrong base_url is found through the chat endpoint, a wrong model through its error
    cfg = _config(tmp_path / "c.toml", gw.url, model="alpha-7")
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert bad[0]["check"] == "base_url" and f'base_url = "{gw.url}/api"' in bad[0]["fix"]
    _follow(bad[0]["fix"], cfg, {})
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert [f["check"] for f in bad] == ["model"] and "alpha-7" in bad[0]["problem"]
    assert "no model list" in bad[0]["problem"]
    # wire_api the gateway does not speak, found without a model list too
    gw.wires = {"chat"}
    cfg = _config(tmp_path / "c.toml", gw.url + "/api", wire="responses")
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert [f["check"] for f in bad] == ["wire_api"] and 'wire_api = "chat"' in bad[0]["fix"]
    _fixed(cfg, dict(ENV), steps=1)


def test_502_page_is_a_server_error_not_a_wrong_url(gw, tmp_path):
    gw.fail = 502
    cfg = _config(tmp_path / "c.toml", gw.url + "/api")
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert len(bad) == 1 and bad[0]["check"] == "server", bad
    assert "502" in bad[0]["problem"] and "Bad Gateway" in bad[0]["problem"]
    assert "web page" not in bad[0]["problem"] and "base_url =" not in bad[0]["fix"]
    gw.fail = 0  # the gateway recovers: the fix is to retry, not to change the config
    assert "retry" in bad[0]["fix"]
    assert all(f["ok"] for f in diagnose(cfg, dict(ENV), timeout=5))
    # failing behind a base_url that also lacks /api: the 502 is named, with where it came from
    gw.fail = 502
    cfg = _config(tmp_path / "c.toml", gw.url)
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert [f["check"] for f in bad] == ["server"] and f"{gw.url}/api" in bad[0]["problem"]
    gw.fail = 0
    _fixed(cfg, dict(ENV), steps=1)


def test_placeholder_model_lists_served_models(gw, tmp_path):
    cfg = _config(tmp_path / "c.toml", gw.url + "/api", model="YOUR_MODEL_ID")
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert [f["check"] for f in bad] == ["model"], bad
    assert "placeholder" in bad[0]["problem"]
    offered = re.findall(r'"([^"]+)"', bad[0]["fix"].split("one of", 1)[1])
    assert offered == MODELS  # every choice listed, none picked for the user
    _fixed(cfg, dict(ENV), steps=1)
    assert 'model = "gamma-70b"' in open(cfg).read()
    # a model id that is merely wrong gets the closest served one
    cfg = _config(tmp_path / "c.toml", gw.url + "/api", model="beta-13")
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert 'set model = "beta-13b"' in bad[0]["fix"]
    _fixed(cfg, dict(ENV), steps=1)


@pytest.mark.parametrize("where", ["body", "headers"])
def test_trickling_server_is_cut_at_one_deadline(gw, tmp_path, where):
    gw.trickle = where
    cfg = _config(tmp_path / "c.toml", gw.url + "/api")
    t0 = time.monotonic()
    bad = _problems(diagnose(cfg, dict(ENV), timeout=1.0))
    took = time.monotonic() - t0
    assert took < 4, took  # one deadline, and no further probes after it expired
    assert bad[0]["check"] == "server" and "within 1 s" in bad[0]["problem"], bad
    t0 = time.monotonic()
    with pytest.raises(ProviderError, match="within 1 s"):
        complete(load_provider(cfg), "sys", "user", dict(ENV), timeout=1.0)
    assert time.monotonic() - t0 < 3
    gw.trickle = False
    assert all(f["ok"] for f in diagnose(cfg, dict(ENV), timeout=5))


def test_base_url_without_scheme(gw, tmp_path):
    cfg = _config(tmp_path / "c.toml", gw.url.removeprefix("http://") + "/api")
    bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
    assert [f["check"] for f in bad] == ["base_url"] and "scheme" in bad[0]["problem"]
    assert gw.seen == []
    _fixed(cfg, dict(ENV), steps=1)
    for placeholder in ("https://YOUR_GATEWAY_HOST/v1", "https://api.example.com/v1"):
        cfg = _config(tmp_path / "c.toml", placeholder)
        bad = _problems(diagnose(cfg, dict(ENV), timeout=5))
        assert [f["check"] for f in bad] == ["base_url"] and "placeholder" in bad[0]["problem"]


def test_missing_key_sends_no_request(gw, tmp_path):
    cfg = _config(tmp_path / "c.toml", gw.url + "/api")
    for env in ({}, {"GW_KEY": ""}, {"GW_KEY": "<your key>"}):
        found = diagnose(cfg, env, timeout=5)
        assert gw.seen == [], gw.seen
        keys = [f for f in found if f["check"] == "key"]
        assert len(keys) == 1 and not keys[0]["ok"] and "GW_KEY" in keys[0]["fix"]
        assert [f["check"] for f in found] == ["config", "key"]
    env = {}
    _fixed(cfg, env, steps=1)
    assert env == {"GW_KEY": KEY}


def test_json_output_is_ordered_and_never_holds_the_key(gw, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GW_KEY", KEY)
    cfg = _config(tmp_path / "c.toml", gw.url, model="YOUR_MODEL_ID")
    assert doctor_main(["--config", cfg, "--json", "--timeout", "5"]) == 1
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert [f["check"] for f in doc] == ["config", "key", "base_url", "model"]
    assert KEY not in out
    assert doctor_main(["--config", cfg, "--timeout", "5"]) == 1
    out = capsys.readouterr().out
    assert KEY not in out and "fix: " in out
