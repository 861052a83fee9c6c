"""Megatron-Core's MoE layers, recorded on CPU, communicate as ``paraloom train``'s.

``examples/megatron_gpt_step.py`` trains megatron-core 0.19.2's ``GPTModel`` with MoE layers
(4 experts, top-2, aux loss 0.01, 2 layers) under ``paraloom record --megatron-on-cpu`` on 4
gloo ranks, and ``paraloom train`` runs the same model and layout:

* the allgather dispatcher (Megatron's default) at tp2 x dp2 x ep2 with sequence parallelism and
  no biases (Megatron's experts take biases only without expert tp): every event of steps 1 and
  2 agrees in op, kind, group, dtype, bytes and shape (``diff --ignore-names``);
* the alltoall dispatcher at dp4 x ep2: every event agrees in op, kind, group, phase, async and
  dtype; the all-to-all sizes follow what each router chose, which differs between two models
  that share no weights, so bytes and shapes are not compared.

One difference remains on every rank, the last event of each step: paraloom's all-reduce of
its MoE statistics (aux and z loss, drops, tokens per expert: ``3 + L E`` float64, kind
``world``) for ``metrics.jsonl``; Megatron-Core's step keeps no such statistics (Megatron-LM's
``training_log`` reduces its own).

* the alltoall dispatcher at tp2 x dp2 x ep2 with sp and a shared expert under
  ``--moe-shared-expert-overlap``: every event agrees in op, kind, group, phase, async and dtype
  (the shared expert's gathers and reduce-scatters between the dispatcher's exchanges, forward
  and backward, and Megatron's all-to-alls launched async on its side stream). Megatron
  all-gathers the received rows over tp with uneven sizes, which gloo refuses: ``--megatron-on-
  cpu`` runs them padded and records them as issued (``paraloom/record/gloo_uneven.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _megatron_record import finish, start_record
from _megatron_source import megatron_file

from paraloom.commands import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megatron_gpt_step.py"
MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
         "--micro-batch-size", "2", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01"]
LAYOUTS = {  # name: (the example's flags, paraloom train's flags, diff's fields)
    "allgather-tp2-sp-dp2-ep2": (
        "--tp 2 --sequence-parallel --ep 2 --disable-bias-linear",
        "--tp 2 --pp 1 --dp 2 --ep 2 --sequence-parallel --disable-bias-linear "
        "--global-batch-size 16", None),
    "alltoall-dp4-ep2": (
        "--ep 2 --moe-token-dispatcher-type alltoall",
        "--tp 1 --pp 1 --dp 4 --ep 2 --moe-token-dispatcher-type alltoall "
        "--global-batch-size 32", "phase,kind,op,async,dtype,group"),
    # tp > 1: the rows gathered over tp with uneven sizes (gloo: run padded, recorded as issued);
    # the shared expert in pieces inside the dispatcher, its all-to-alls launched async
    "alltoall-tp2-sp-ep2-shared-overlap": (
        "--tp 2 --sequence-parallel --ep 2 --disable-bias-linear --moe-token-dispatcher-type "
        "alltoall --moe-shared-expert-intermediate-size 128 --moe-shared-expert-overlap",
        "--tp 2 --pp 1 --dp 2 --ep 2 --sequence-parallel --disable-bias-linear "
        "--moe-token-dispatcher-type alltoall --moe-shared-expert-intermediate-size 128 "
        "--moe-shared-expert-overlap --global-batch-size 16", "phase,kind,op,async,dtype,group"),
}
MOE_EVENTS = {  # (op, kind) of Megatron's MoE layers' own events, per layout
    "allgather-tp2-sp-dp2-ep2": {("all_gather", "tp_ep"), ("reduce_scatter", "tp_ep")},
    "alltoall-dp4-ep2": {("all_gather", "tp_ep"), ("all_to_all", "ep")},
    "alltoall-tp2-sp-ep2-shared-overlap": {
        ("all_gather", "tp_ep"), ("all_to_all", "ep"), ("all_gather", "etp"),
        ("reduce_scatter", "etp"), ("all_gather", "tp"), ("reduce_scatter", "tp")},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (Megatron's record folder, paraloom's run folder); both records at once."""
    megatron_file("transformer/moe/token_dispatcher.py")  # installed, or fail
    tmp = tmp_path_factory.mktemp("megatron_moe")
    procs = {name: start_record(tmp / f"megatron-{name}", EXAMPLE, [*MODEL, *ex.split()])
             for name, (ex, _, _) in LAYOUTS.items()}
    for name, proc in procs.items():
        code, text = finish(proc, 420)
        assert code == 0 and "step 2: loss" in text, f"{name}: {text[-3000:]}"
    out = {}
    for name, (_, flags, _) in LAYOUTS.items():
        ours = tmp / f"paraloom-{name}"
        assert main(["train", *MODEL, *flags.split(), "--steps", "2", "--ledger-steps", "2",
                     "--no-overlap-p2p-communication", "--no-megatron-lm-loop",
                     "--save-every", "0", "--timeout", "120", "--out", str(ours)]) == 0, name
        out[name] = (tmp / f"megatron-{name}", ours)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_moe_layers_equal_paraloom_train(runs, name, capsys):
    megatron, ours = runs[name]
    fields = LAYOUTS[name][2]
    for step in ("2", "1"):
        capsys.readouterr()
        code = main(["diff", str(megatron), str(ours), "--step", step, "--ignore-names",
                     *(["--fields", fields] if fields else [])])
        text = capsys.readouterr().out
        assert code == 1, text  # the statistics' all-reduce, below
        counts = re.findall(r"rank \d: different \((\d+) vs (\d+) communications: (\d+) equal, "
                            r"0 changed, 0 only in A, 1 only in B\)", text)
        assert len(counts) == 4, text
        assert all(int(b) == int(a) + 1 == int(eq) + 1 for a, b, eq in counts), text
        extra = re.findall(r"\|\s+\d+\s+optimizer\s+world\s+all_reduce", text)
        assert len(extra) == 4, text
    # not vacuous: Megatron's own dispatcher is on the record, in its MoE layers
    events = [json.loads(line) for line in (megatron / "ledger.jsonl").read_text().splitlines()]
    moe = {(e["op"], e["kind"]) for e in events
           if e.get("step") == 2 and (e.get("module") or "").endswith(".mlp")}
    assert moe == MOE_EVENTS[name], moe
    if "overlap" in name:  # the uneven gathers, recorded with their splits; async all-to-alls
        uneven = [e for e in events if e["op"] == "all_gather" and e.get("output_splits")]
        assert uneven and all(e["shape"][0] == e["output_splits"][e["group"].index(e["rank"])]
                              for e in uneven)
        assert all(e["async"] for e in events if e["op"] == "all_to_all")
