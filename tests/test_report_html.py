"""The HTML run report in a real browser, and TensorBoard scalars read back by tensorboard.

One small real run (``paraloom train``, tp=2 pp=2, 2 steps, with ``--tensorboard-dir``) and one
``paraloom record`` of an unmodified torch DDP program are started together; their
``report.html`` pages are opened in headless Chromium (Debian's ``chromium``; the README's test
command installs it, and these tests fail without it). What the page must show is derived from
the formulas (:func:`paraloom.analysis.formulas.expected_comm`) and the run's own files, never
from a previous report. The screenshot is kept in ``tmp/test-artifacts/`` (not committed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tmp" / "test-artifacts"
TRAIN = ["--tp", "2", "--pp", "2", "--dp", "1", "--layers", "4", "--hidden", "32", "--heads", "4",
         "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "1", "--steps", "2",
         "--save-every", "0", "--tensorboard-log-interval", "1"]
DDP = textwrap.dedent('''
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
''')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"train": folder, "tb": folder, "record": folder}``, both runs started together."""
    tmp = tmp_path_factory.mktemp("report")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    (tmp / "ddp.py").write_text(DDP)
    procs = {
        "train": subprocess.Popen([sys.executable, "-m", "paraloom", "train", *TRAIN, "--out",
                                   str(tmp / "train"), "--tensorboard-dir", str(tmp / "tb")],
                                  env=env, cwd=tmp, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True),
        "record": subprocess.Popen([sys.executable, "-m", "paraloom", "record", "--nproc", "2",
                                    "--out", str(tmp / "record"), "--", str(tmp / "ddp.py")],
                                   env=env, cwd=tmp, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)}
    logs = {}
    for name, proc in procs.items():
        logs[name], _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{name}: {logs[name]}"
    return {"train": tmp / "train", "tb": tmp / "tb", "record": tmp / "record", "tmp": tmp,
            "train_log": logs["train"]}


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: the browser test needs Debian's chromium "
                    "package (apt-get install -y chromium; the README's test command does it)")
    return path


def _browse(page: Path, tmp: Path, *, hash_: str = "", shot: Path | None = None) -> tuple:
    """Open ``page`` headless; returns (DOM after the scripts ran, console lines)."""
    profile = tmp / f"profile-{os.getpid()}-{len(list(tmp.iterdir()))}"
    what = [f"--screenshot={shot}", "--window-size=1400,2600"] if shot else ["--dump-dom"]
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", f"--user-data-dir={profile}",
                           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=8000",
                           *what, page.resolve().as_uri() + hash_],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console


def _expected_rows(run: Path) -> int:
    """Communications of rank 0 in its first step (the table's), by the formulas (stage 0)."""
    from paraloom.analysis.formulas import expected_comm
    from paraloom.verify.check import config_from_run, step_config
    config = step_config(config_from_run(json.loads((run / "config.json").read_text())), 1, {})
    return sum(v["count"] for (kind, op, phase), v in expected_comm(config, 0).items()
               if phase != "setup")


def _table(dom: str, lang: str) -> str:
    m = re.search(rf'<table class="comm" data-lang="{lang}"[^>]*>(.*?)</table>', dom, re.S)
    assert m, f"no {lang} communication table"
    return m.group(0)


def test_report_in_chromium_table_switch_and_lanes(runs):
    page = runs["train"] / "report.html"
    html = page.read_text()
    assert len(html.encode()) < 3_000_000
    assert not re.search(r'(src|href)="(https?:)?//|<link ', html)  # nothing from the network
    dom, console = _browse(page, runs["tmp"])
    errors = re.search(r'<pre id="load-errors"[^>]*>(.*?)</pre>', dom, re.S)
    assert errors and json.loads(errors.group(1)) == [], errors
    assert 'data-ready="1"' in dom
    assert not [line for line in console if re.search(r"Uncaught|Error", line)], console
    en = _table(dom, "en")
    assert "hidden" not in en.split(">")[0] and "<th>Parallel type</th>" in en
    rows, members = en.count('<tr class="row"'), en.count('<tr class="member"')
    folded = en.count('class="fold"')
    assert folded > 0 and rows - folded + members == _expected_rows(runs["train"])
    batch = re.search(r'<tr class="row" data-row="1">(.*?)</tr>', en, re.S).group(1)
    assert "<td>broadcast</td>" in batch and "megatron_lm_loop.py:" in batch  # Megatron-LM's loop
    assert re.search(r"<li>line \d+ [\w.]+: broadcast \(tp, data, async False\)", batch)
    first = next(row for row in re.findall(r'<tr class="row" data-row="\d+">(.*?)</tr>', en, re.S)
                 if "<td>all_reduce</td>" in row)
    assert "<td>tp</td>" in first
    assert "paraloom/tensor_parallel/embedding.py:" in first  # its source, with explain's facts
    assert re.search(r"<li>line \d+ [\w.]+: all_reduce \(tp, forward, async False\)", first)
    lanes = re.findall(r'<g class="lane" data-rank="(\d+)"', dom)
    assert sorted(map(int, lanes)) == [0, 1, 2, 3]
    # the schedule: one row per rank, a backward block per microbatch (4 = 4 / (1 * dp 1))
    assert 'class="schedule"' in dom and dom.count('<g class="blk B">') == 4 * 4
    assert 'id="verdict">paraloom check: all' in dom and "verdict ok" in dom
    # the zh button, pressed: headings and the table's columns change language
    zh_dom, console = _browse(page, runs["tmp"], hash_="#click=zh&open=5")
    assert not [line for line in console if re.search(r"Uncaught|Error", line)], console
    assert '<h2 data-en="Communication order" data-zh="通信顺序">通信顺序</h2>' in zh_dom
    assert '>Communication order</h2>' in dom
    zh = _table(zh_dom, "zh")
    assert "hidden" not in zh.split(">")[0] and "<th>并行类型</th>" in zh
    assert "hidden" in _table(zh_dom, "en").split(">")[0]
    # row 5 (a folded layer row, after the batch broadcast and the embedding), expanded by its
    # button: its layers' rows are shown
    opened = re.findall(r'<tr class="member" data-parent="5"( hidden="")?>', zh)
    assert len(opened) == 2 and opened == ["", ""]  # 2 layers per stage, none hidden
    assert re.findall(r'<tr class="member" data-parent="6"( hidden="")?>', zh) == [' hidden=""'] * 2
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    _browse(page, runs["tmp"], shot=shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_report_of_a_recorded_torch_ddp_run(runs):
    page = runs["record"] / "report.html"
    assert page.is_file()
    dom, console = _browse(page, runs["tmp"])
    assert not [line for line in console if re.search(r"Uncaught|Error", line)], console
    assert json.loads(re.search(r'<pre id="load-errors"[^>]*>(.*?)</pre>', dom, re.S)
                      .group(1)) == []
    assert sorted(map(int, re.findall(r'<g class="lane" data-rank="(\d+)"', dom))) == [0, 1]
    en = _table(dom, "en")
    from paraloom.run_folder import read_json_lines as load
    events = [e for e in load(runs["record"] / "ledger.jsonl") if e["rank"] == 0
              and e["step"] == 1 and e["op"] != "compute" and e["phase"] != "setup"]
    assert events and en.count('<tr class="row"') == len(events)
    assert "<td>all_reduce</td>" in en and "ddp.py:" in en  # the program's own file:line
    assert "no formula check" in dom


def test_tensorboard_scalars_read_back(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from paraloom.analysis.formulas import expected_comm
    from paraloom.training.tensorboard import TAGS
    from paraloom.verify.check import config_from_run, step_config
    acc = EventAccumulator(str(runs["tb"]))
    acc.Reload()
    metrics = [json.loads(line) for line in
               (runs["train"] / "metrics.jsonl").read_text().splitlines()]
    config = config_from_run(json.loads((runs["train"] / "config.json").read_text()))

    def per_kind(step: int) -> dict[str, int]:  # the writer is the last rank: the last stage
        out: dict[str, int] = {}
        for (kind, _, phase), v in expected_comm(step_config(config, step, {}),
                                                 config.pp - 1).items():
            if phase != "setup" and v["bytes"]:
                out[kind] = out.get(kind, 0) + v["bytes"]
        return out
    tags = set(acc.Tags()["scalars"])
    assert tags == set(TAGS) | {f"comm-bytes/{k}" for k in per_kind(1)}
    for tag, key in zip(TAGS[:3], ("loss", "lr", "grad_norm"), strict=True):
        got = acc.Scalars(tag)  # float32 values
        # one step number everywhere: TensorBoard's is metrics.jsonl's, from 1
        assert [s.step for s in got] == [m["step"] for m in metrics] == [1, 2]
        assert [s.value for s in got] == pytest.approx([m[key] for m in metrics], rel=1e-6)
    assert all(s.value > 0 for s in acc.Scalars(TAGS[3]))
    for kind in per_kind(1):
        assert [(s.step, s.value) for s in acc.Scalars(f"comm-bytes/{kind}")] == [
            (1, per_kind(1)[kind]), (2, per_kind(2)[kind])]
    assert per_kind(1)["mp"] == per_kind(2)["mp"] + 4  # the first step's one-off flag


def test_cli_errors_and_options(runs, tmp_path, monkeypatch, capsys):
    from paraloom.commands import main
    assert main(["report", str(tmp_path)]) == 2
    assert "no ledger" in capsys.readouterr().err
    out = tmp_path / "r.html"
    assert main(["report", str(runs["train"]), "--out", str(out), "--lang", "zh"]) == 0
    assert '<body data-lang="zh">' in out.read_text()
    assert main(["train", *TRAIN, "--log-interval", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--log-interval must be a positive integer, got 0" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    assert main(["train", *TRAIN, "--tensorboard-dir", str(tmp_path / "tb"), "--out",
                 str(tmp_path / "y")]) == 2
    assert "pip install 'paraloom[tensorboard]'" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_source_sites_and_expert_load(runs, tmp_path):
    from paraloom.report.html import render_report
    from paraloom.report.sources import resolve_site, site_facts
    place = resolve_site("finalize_model_grads:embedding_grads")  # a label written in source
    assert place["file"] == "paraloom/data_parallel/finalize.py" and place["how"] == "label"
    line = Path(place["path"]).read_text().splitlines()[place["line"] - 1]
    assert "finalize_model_grads:embedding_grads" in line
    assert [f["op"] for f in site_facts(place, "all_reduce", "optimizer")] == ["all_reduce"]
    gone = resolve_site("/nowhere/train.py:12 step")  # a recorded program's file, not here
    assert (gone["file"], gone["line"]) == ("/nowhere/train.py", 12)
    assert site_facts(gone, "all_reduce", "backward") is None
    assert resolve_site("no_such_thing:x") is None
    # a label found as its class: the Source column names the call site, not the class line
    from paraloom.report.sections import _facts_html
    place = resolve_site("RowParallelLinear.forward:output")
    assert place["how"] == "class"
    cell = _facts_html(place, {"primitive": "all_reduce", "phase": "forward"})
    call = site_facts(place, "all_reduce", "forward")[0]["line"]
    assert call != place["line"] and f"layers.py:{call}</summary>" in cell, cell
    assert f"class at line {place['line']}, its call site" in cell
    p2p = resolve_site("p2p.send_forward")  # a module: its batched send/recv call
    assert site_facts(p2p, "send", "forward"), p2p
    run = tmp_path / "moe"
    shutil.copytree(runs["train"], run)
    png = runs["train"] / "loss.png"  # any PNG stands for the MoE engineer's picture
    shutil.copy(png, run / "expert_load.png")
    page = render_report(run)
    assert 'data-en="Expert load"' in page and "data:image/png;base64," in page
    assert 'data-en="Expert load"' not in render_report(runs["train"])
    from paraloom.report.sections import timeline_data
    from paraloom.run_folder import read_json_lines as load
    events = load(runs["train"] / "ledger.jsonl")
    one = timeline_data(events, max_steps=1)  # a long ledger: set-up and the first steps drawn
    assert (one["steps"], one["of"]) == ([1], 2)
    assert len(one["ev"]) == sum(e["step"] in (0, 1) for e in events) and len(one["ev"]) > 0


def _steps(events: list[dict]) -> list[int]:
    return sorted({e["step"] for e in events if e["phase"] != "setup"})


def test_steps_count_from_one_everywhere(runs, tmp_path, capsys):
    """One step number in every output, Megatron's (iterations from 1): the progress line,
    metrics.jsonl, the ledger (set-up is step 0), a recorded program's ledger, and the readers'
    ``--step``; a folder written when the first step was 0 reads as a new one."""
    from paraloom.commands import main
    from paraloom.run_folder import read_json_lines as load
    train, record = runs["train"], runs["record"]
    assert re.findall(r"\] step (\d+)/2 ", runs["train_log"]) == ["1", "2"]
    assert [m["step"] for m in load(train / "metrics.jsonl")] == [1, 2]
    events = load(train / "ledger.jsonl")
    assert _steps(events) == [1, 2]
    assert {e["step"] for e in events if e["phase"] == "setup"} == {0}
    assert "step 2 (steady-state" in runs["train_log"]
    assert _steps(load(record / "ledger.jsonl")) == [1, 2]  # the DDP program's two iterations
    assert {e["step"] for e in load(record / "ledger.jsonl") if e["phase"] == "setup"} == {0}
    capsys.readouterr()
    assert main(["check", str(train)]) == 0
    assert re.findall(r"^## step (\d+)", capsys.readouterr().out, re.M) == ["1", "2"]
    assert main(["table", str(train), "--step", "0"]) == 2
    assert "steps count from 1" in capsys.readouterr().err
    assert main(["diff", str(train), str(train), "--step", "0"]) == 2
    assert "steps count from 1" in capsys.readouterr().err
    # a folder of the old convention: first step 0 in metrics.jsonl and the ledger
    old = tmp_path / "old"
    shutil.copytree(train, old)
    for name in ("metrics.jsonl", "ledger.jsonl"):
        rows = load(old / name)
        rows = [{**r, "step": r["step"] - 1} if r.get("phase") != "setup" else r for r in rows]
        (old / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _steps(load(old / "ledger.jsonl")) == [0, 1]
    capsys.readouterr()
    assert main(["table", str(old), "--step", "2"]) == 0
    old_table = capsys.readouterr().out
    assert main(["table", str(train), "--step", "2"]) == 0
    assert capsys.readouterr().out == old_table
    assert main(["check", str(old)]) == 0
    assert re.findall(r"^## step (\d+)", capsys.readouterr().out, re.M) == ["1", "2"]
    assert main(["diff", str(old), str(train)]) == 0
