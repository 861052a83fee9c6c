"""explain --ask and doctor against a real HTTP server on 127.0.0.1 (stdlib http.server in a
thread) that speaks the chat-completions and responses protocols and fails on cue."""

from __future__ import annotations

import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from paraloom.commands.doctor import main as doctor_main
from paraloom.commands.explain import main as explain_main
from paraloom.explain import contradictions
from paraloom.llm import diagnose

KEY = "sk-test-0123456789"
SNIPPET = '''\
import torch

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        torch.distributed.all_reduce(grad, group=ctx.tp_group)
        return grad
'''


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, body):
        srv = self.server
        srv.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        if not self.path.startswith("/v1/"):
            return self._send(404, "<!doctype html><html>Example Inc.</html>", "text/html")
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": {"message": "invalid api key"}})
        if self.path == "/v1/models":
            return self._send(200, {"data": [{"id": "good-model"}, {"id": "other-model"}]})
        wire = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}.get(self.path)
        if wire is None or wire not in srv.wires:
            return self._send(404, {"error": {"message": f"no route {self.path}"}})
        if body.get("model") != "good-model":
            return self._send(404, {"error": {"message": f"model {body.get('model')} does not "
                                                         f"exist", "code": "model_not_found"}})
        text = srv.answer
        if wire == "chat":
            return self._send(200, {"choices": [{"message": {"role": "assistant",
                                                             "content": text}}]})
        return self._send(200, {"output": [{"type": "message", "content": [
            {"type": "output_text", "text": text}]}]})

    def do_GET(self):
        self._route({})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        self._route(json.loads(self.rfile.read(n) or b"{}"))


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """urllib honours *_proxy variables; the local server must be reached directly."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen, srv.wires, srv.answer = [], {"chat", "responses"}, ""
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    stop = threading.Timer(60, srv.shutdown)  # bounded: stops by itself
    stop.daemon = True
    stop.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    stop.cancel()
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def _config(tmp_path, base_url, model="good-model", wire="chat", env_key="PARALOOM_TEST_KEY"):
    path = tmp_path / "config.toml"
    path.write_text(f'model = "{model}"\nmodel_provider = "local"\n\n'
                    f'[model_providers.local]\nname = "local"\nbase_url = "{base_url}"\n'
                    f'env_key = "{env_key}"\nwire_api = "{wire}"\n')
    return str(path)


@pytest.mark.parametrize("wire", ["chat", "responses"])
def test_ask_sends_snippet_and_facts_and_flags_contradictions(server, tmp_path, monkeypatch,
                                                             capsys, wire):
    monkeypatch.setenv("PARALOOM_TEST_KEY", KEY)
    server.answer = ("The all-reduce runs in the forward pass. It syncs the input gradient "
                     "(line 10).")
    src = tmp_path / "region.py"
    src.write_text(SNIPPET)
    cfg = _config(tmp_path, server.url + "/v1", wire=wire)
    # the answer contradicts the facts: the flags are printed and the exit status says so
    assert explain_main(["--ask", "where is the all-reduce?", str(src), "--config", cfg]) == 1
    out = capsys.readouterr().out
    assert out.startswith("The all-reduce runs in the forward pass.")
    assert "!! contradicts the facts" in out and "in backward" in out
    assert "extracted facts, for comparison" in out and "## Communication sites" in out
    method, path, auth, body = server.seen[-1]
    assert (method, path, auth) == ("POST", "/v1/chat/completions" if wire == "chat"
                                    else "/v1/responses", f"Bearer {KEY}")
    sent = json.dumps(body)
    assert "torch.distributed.all_reduce(grad" in sent and '\\"phase\\": \\"backward\\"' in sent
    assert KEY not in sent  # the key travels only in the Authorization header


def test_ask_about_stdin_sends_the_code_read_once(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARALOOM_TEST_KEY", KEY)
    monkeypatch.setattr("sys.stdin", io.StringIO(SNIPPET))
    server.answer = "The all-reduce syncs the gradient in backward."
    assert explain_main(["--ask", "q", "-", "--config", _config(tmp_path, server.url + "/v1")]) == 0
    assert "## Communication sites" in capsys.readouterr().out
    assert "torch.distributed.all_reduce(grad" in json.dumps(server.seen[-1][3])

def test_contradiction_check_is_grounded():
    facts = {"lines": [1, 11], "sites": [{"op": "all_reduce", "phase": "backward", "line": 10}]}
    assert contradictions("The all-reduce is in backward (line 10).", facts) == []
    flags = contradictions("all_reduce happens in forward. See line 42.", facts)
    assert len(flags) == 2 and "backward" in flags[0] and "line 42" in flags[1]
    assert contradictions("反向传播中 all-reduce 同步梯度。", facts) == []
    assert contradictions("前向时做 all-reduce。", facts)


def test_ask_with_missing_key_fails_naming_the_variable(server, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PARALOOM_TEST_KEY", raising=False)
    src = tmp_path / "region.py"
    src.write_text(SNIPPET)
    cfg = _config(tmp_path, server.url + "/v1")
    assert explain_main(["--ask", "q", str(src), "--config", cfg]) == 2  # setup: bad input
    assert "PARALOOM_TEST_KEY" in capsys.readouterr().err
    assert server.seen == []  # nothing was sent without a key
    # no config at all: exit 2, and the help shows the table to write
    assert explain_main(["--ask", "q", str(src), "--config", str(tmp_path / "none.toml")]) == 2
    err = capsys.readouterr().err
    assert "no provider config at" in err and "paraloom explain --help" in err
    with pytest.raises(SystemExit):
        explain_main(["--help"])
    assert "[model_providers.openai]" in capsys.readouterr().out
    assert explain_main(["--ask", "q", str(src), "--config", cfg, "--timeout", "0"]) == 2
    assert "--timeout 0: expected seconds" in capsys.readouterr().err


def test_ask_timeout_bounds_the_answer_and_the_name_lookup(server, tmp_path, monkeypatch,
                                                          capsys):
    """--ask --timeout is the deadline of the whole answer, host name lookup included (a
    lookup blocks where no socket can be cut)."""
    import socket
    monkeypatch.setenv("PARALOOM_TEST_KEY", KEY)
    src = tmp_path / "region.py"
    src.write_text(SNIPPET)
    cfg = _config(tmp_path, "http://lookup.invalid:9/v1")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: time.sleep(30))
    t0 = time.monotonic()
    assert explain_main(["--ask", "q", str(src), "--config", cfg, "--timeout", "0.5"]) == 1
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert "within 0.5 s (the host name lookup or the connection did not finish)" in err, err


def _problems(found):
    return {f["check"]: f for f in found if not f["ok"]}


def test_doctor_diagnoses_each_usual_mistake(server, tmp_path, monkeypatch):
    env = {"PARALOOM_TEST_KEY": KEY, "HOME": str(tmp_path)}
    good = diagnose(_config(tmp_path, server.url + "/v1"), env)
    assert all(f["ok"] for f in good), good
    # key variable missing / empty -> 401
    for value in (None, ""):
        e = {"HOME": str(tmp_path)} if value is None else {"PARALOOM_TEST_KEY": ""}
        p = _problems(diagnose(_config(tmp_path, server.url + "/v1"), e))
        assert "401" in p["key"]["problem"] and "export PARALOOM_TEST_KEY=" in p["key"]["fix"]
    # wrong key -> the endpoint's 401
    p = _problems(diagnose(_config(tmp_path, server.url + "/v1"), {"PARALOOM_TEST_KEY": "bad"}))
    assert "401" in p["key"]["problem"]
    # base_url lacking /v1 (the site's web page) -> 404, fix adds /v1
    p = _problems(diagnose(_config(tmp_path, server.url), env))
    assert "lacks the API path" in p["base_url"]["problem"]
    assert "web page" in p["base_url"]["problem"]
    assert f'base_url = "{server.url}/v1"' in p["base_url"]["fix"]
    # an extra /v1 the client adds again
    p = _problems(diagnose(_config(tmp_path, server.url + "/v1/v1"), env))
    assert "extra /v1" in p["base_url"]["problem"]
    assert f'base_url = "{server.url}/v1"' in p["base_url"]["fix"]
    # unknown model id, checked against the model list
    p = _problems(diagnose(_config(tmp_path, server.url + "/v1", model="good-modle"), env))
    assert "good-modle" in p["model"]["problem"] and 'model = "good-model"' in p["model"]["fix"]
    # wire_api mismatch: the endpoint only speaks chat
    server.wires = {"chat"}
    p = _problems(diagnose(_config(tmp_path, server.url + "/v1", wire="responses"), env))
    assert 'wire_api = "chat"' in p["wire_api"]["fix"]
    # nothing is listening
    p = _problems(diagnose(_config(tmp_path, "http://127.0.0.1:9/v1"), env))
    assert "cannot reach" in p["base_url"]["problem"]
    for *_, body in server.seen:
        assert KEY not in json.dumps(body)


def test_doctor_cli_reads_codex_home_and_never_prints_the_key(server, tmp_path, monkeypatch,
                                                              capsys):
    home = tmp_path / ".codex"
    home.mkdir()
    _config(home, server.url + "/v1", model="nope")
    monkeypatch.setenv("CODEX_HOME", str(home))
    monkeypatch.setenv("PARALOOM_TEST_KEY", KEY)
    assert doctor_main([]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  model" in out and "fix:" in out and KEY not in out
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "empty"))
    assert doctor_main([]) == 1
    out = capsys.readouterr().out  # the fix is the table itself, at the path it is read from
    assert f"fix: write {tmp_path / 'empty' / 'config.toml'} like this" in out, out
    assert "[model_providers.openai]" in out and 'env_key = "OPENAI_API_KEY"' in out
    monkeypatch.setenv("CODEX_HOME", str(home))
    _config(home, server.url + "/v1")
    assert doctor_main([]) == 0
    assert KEY not in capsys.readouterr().out


def test_contradiction_check_flags_a_wrong_line_inside_the_snippet():
    facts = {"lines": [1, 11], "sites": [{"op": "all_reduce", "phase": "backward", "line": 10},
                                         {"op": "all_gather", "phase": "forward", "line": 6}]}
    flags = contradictions("The all-reduce of the gradient is at line 5.", facts)
    assert len(flags) == 1 and "line 5" in flags[0] and "all_reduce" in flags[0] \
        and "[10]" in flags[0]
    assert contradictions("第 5 行做 all-reduce。", facts)
    assert contradictions("The all-gather (line 10) collects the output.", facts)
    for right in ("The all-reduce of the gradient is at line 10.",
                  "Lines 9-11 hold the all-reduce.", "The all-reduce (lines 4 and 10) syncs.",
                  "The all-gather on line 6 and the all-reduce on line 10.",
                  "Line 5 returns x; no broadcast happens.", "第 10 行做 all-reduce。",
                  "Line 3 defines the class; the all-reduce syncs the gradient."):
        assert contradictions(right, facts) == [], right


def test_ask_exit_status_follows_the_flags(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARALOOM_TEST_KEY", KEY)
    src = tmp_path / "region.py"
    src.write_text(SNIPPET)
    cfg = _config(tmp_path, server.url + "/v1")
    server.answer = "The all-reduce runs in backward (line 10)."
    assert explain_main(["--ask", "q", str(src), "--config", cfg]) == 0
    assert "!!" not in capsys.readouterr().out
    server.answer = "The all-reduce runs in backward (line 3)."
    assert explain_main(["--ask", "q", str(src), "--config", cfg, "--json"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert len(doc["ask"]["flags"]) == 1 and "line 3" in doc["ask"]["flags"][0]
    assert "contradict" in captured.err
