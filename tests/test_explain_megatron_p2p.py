"""``explain`` on Megatron-Core's pipeline point-to-point calls agrees with what they do.

``paraloom record --nproc 2 -- tests/_megatron_p2p.py`` runs megatron-core 0.19.2's
``P2PCommunicator`` on 2 gloo ranks: rank 0 (first stage) ``send_forward``, ``recv_backward``,
``send_forward_recv_backward``; rank 1 (last stage) ``recv_forward``, ``send_backward``,
``send_backward_recv_forward``; once with ``batch_p2p_comm`` off (``_p2p_ops``: one
``isend`` / ``irecv`` each) and once on (``_batched_p2p_ops``: the same ops through
``batch_isend_irecv``), a barrier after each call. ``explain p2p_communication.py --set ...``
(that run's settings) must list, for each of those methods, exactly the recorded sends and
receives (op, async; nothing open), through the function that really issued them (the alias
``p2p_func`` decided by ``config.batch_p2p_comm``), in the phase of Megatron's roles (activations
forward, their gradients backward), with a ``batch_isend_irecv`` site exactly when batched.

The recorder marks every event ``setup`` here (the program runs no training step), so the phase
is checked against the roles, not the record; ``batch_isend_irecv`` is recorded as the sends and
receives it launches (torch issues each op of the batch), so the static ``batch_p2p`` site is
checked for presence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from _megatron_p2p import CALLS
from _megatron_source import megatron_file

from paraloom.explain import explain
from paraloom.explain.conditions import parse_settings
from paraloom.run_folder import read_json_lines as load

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"send_forward": {"send": "forward"}, "recv_forward": {"recv": "forward"},
         "send_backward": {"send": "backward"}, "recv_backward": {"recv": "backward"},
         "send_forward_recv_backward": {"send": "forward", "recv": "backward"},
         "send_backward_recv_forward": {"send": "backward", "recv": "forward"}}
"""Megatron's roles: activations move forward, their gradients backward."""


def _record(out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.Popen([sys.executable, "-m", "paraloom", "record", "--nproc", "2", "--out",
                             str(out), "--", str(ROOT / "tests" / "_megatron_p2p.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stdout + stderr[-4000:]
    assert stdout.count("megatron-core p2p ok") == 2, stdout
    return load(out / "ledger.jsonl")


def _calls(events: list[dict], rank: int) -> list[list[dict]]:
    """Rank ``rank``'s events cut at its barriers: one list per P2PCommunicator call."""
    out, current = [], []
    for e in events:
        if e["rank"] != rank:
            continue
        if e["op"] == "barrier":
            out.append(current)
            current = []
        else:
            current.append(e)
    assert current == [], current
    return out


def _settings(batched: bool) -> dict:
    return parse_settings([
        "config.use_ring_exchange_p2p=False", f"config.batch_p2p_comm={batched}",
        "config.variable_seq_lengths=False", "config.mtp_standalone=False",
        "is_first_stage=False", "is_last_stage=False",
        "output_tensor=tensor", "input_tensor_grad=tensor"])  # a tensor: never None


def test_p2p_family_static_reading_equals_the_record(tmp_path):
    events = _record(tmp_path / "p2p")
    path = str(megatron_file("pipeline_parallel/p2p_communication.py"))
    for half, batched in enumerate((False, True)):
        facts = explain(path, settings=_settings(batched))
        helper = "_batched_p2p_ops" if batched else "_p2p_ops"
        for rank in (0, 1):
            calls = _calls(events, rank)
            assert len(calls) == 2 * len(CALLS[rank]), calls
            for name, recorded in zip(CALLS[rank], calls[half * 3:half * 3 + 3], strict=True):
                mine = [s for s in facts["sites"] if s["class"] == "P2PCommunicator"
                        and s["function"] == name]
                assert all(s["active"] is True and s["open"] == [] for s in mine), (name, mine)
                p2p = [s for s in mine if s["op"] != "batch_p2p"]
                assert sorted((s["op"], s["async"]) for s in p2p) == sorted(
                    (e["op"], e["async"]) for e in recorded), (name, batched, mine, recorded)
                assert any(s["op"] == "batch_p2p" for s in mine) == batched, (name, mine)
                assert {s["op"]: s["phase"] for s in p2p} == ROLES[name], (name, p2p)
                assert {s["via"][-1] for s in p2p} == {helper}, (name, p2p)
                assert {e["site"].rsplit(" ", 1)[-1] for e in recorded} == {helper}, recorded
        other = "_p2p_ops" if batched else "_batched_p2p_ops"  # ruled out, listed as such
        assert {s["function"] for s in facts["inactive"] if s["class"] == "P2PCommunicator"
                and s["via"][-1:] == [other]} >= set(ROLES), facts["inactive"]
        assert {s["function"] for s in facts["inactive"] if s["op"] == "send_recv"} >= set(ROLES)
