"""``paraloom plan --explain-error ROW``: a published Megatron run next to ``plan``'s prediction
of it (:mod:`paraloom.verify.validation`), so that one sees which part of the predicted step
carries the error::

    paraloom plan --explain-error narayanan-76.1B      # one row: layout, figures, breakdown
    paraloom plan --explain-error all                  # every row, mean and worst error

A publication reports one figure per run (TFLOP/s per GPU, or MFU); since the figure is the
step's work over its time and the work is the model's own count, the figure gives the step time
the run achieved. The gap between that and the predicted step is set against each part of the
predicted step: "to close the gap alone" is the factor that part would need, so a part smaller
than the gap cannot carry it by itself, and a part that would have to double is an unlikely
culprit.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..verify.validation import explain_row, summary, validate

__all__ = ["main", "render_row", "render_all"]

_PARTS = {"compute": "compute", "recompute": "recompute", "tp_comm": "exposed tp/sp comm",
          "cp_comm": "exposed cp comm", "ep_comm": "ep dispatcher comm",
          "pp_comm": "exposed pp p2p", "bubble": "pipeline bubble",
          "dp_comm": "exposed dp comm", "emb_comm": "embedding, loss sums",
          "optimizer": "optimizer step"}


def render_row(r: dict) -> str:
    """:func:`~paraloom.verify.validation.explain_row`'s dict for people."""
    lay = r["layout"]
    role = "used for calibration" if r["calibration"] else "predicted, not calibrated on"
    recompute = {"full": "full recomputation", "selective": "selective recomputation"}.get(
        lay["recompute"], "no recomputation")
    extras = [text for key, text in (
        ("sequence_parallel", "sequence parallel"), ("distributed_optimizer",
         "distributed optimizer"), ("fused_attention", "fused attention"),
        ("tp_comm_overlap", "tp comm overlap")) if lay.get(key)]
    if not lay["overlap_grad_reduce"]:
        extras.append("gradients reduced after backward")
    lines = [
        f"{r['row']}  ({r['source']}; {role})",
        f"layout: GPT L={lay['layers']} h={lay['hidden']} heads={lay['heads']} "
        f"s={lay['seq_len']} V={lay['vocab']}; tp {lay['tp']}, pp {lay['pp']}"
        + (f" (interleaved, {lay['vpp']} virtual stages)" if lay.get("vpp", 1) > 1 else "")
        + f", dp {lay['dp']} on {lay['gpus']} x {r['hardware']}; global batch "
        f"{lay['global_batch']} = {lay['microbatches']} microbatches of {lay['micro_batch']} "
        f"per pipeline; " + "; ".join([recompute] + extras),
        f"published  {r['published']:8.4g} {r['unit']:<16} -> step {r['published_step_s']:.3f} s",
        f"predicted  {r['predicted']:8.4g} {r['unit']:<16} -> step {r['predicted_step_s']:.3f} s"
        f"  ({r['error']:+.1%})",
        f"the model is {abs(r['gap_s']):.3f} s too {'fast' if r['gap_s'] < 0 else 'slow'}; "
        "each part of the predicted step, and what it alone would need to close the gap:",
        f"  {'part':<22} {'seconds':>9} {'share':>7}  to close the gap alone"]
    for p in r["parts"]:
        need = "impossible (it would go below 0)" if p["alone"] < 0 else f"x{p['alone']:.2f}"
        lines.append(f"  {_PARTS.get(p['part'], p['part']):<22} {p['seconds']:9.4f} "
                     f"{p['share']:7.1%}  {need}")
    return "\n".join(lines)


def render_all(rows: list[dict], s: dict) -> str:
    """The validation table, then the error on the rows not used for calibration."""
    lines = [f"{'row':<24} {'published':>9} {'predicted':>9} {'unit':<16} {'error':>7}  "
             "calibration", "-" * 82]
    lines += [f"{r['row']:<24} {r['published']:9.4g} {r['predicted']:9.4g} {r['unit']:<16} "
              f"{r['error']:+7.1%}  {'yes' if r['calibration'] else ''}" for r in rows]
    lines.append("error: predicted over published throughput - 1 (+: the model is too fast)")
    lines.append(f"{s['rows']} rows not used for calibration: mean |error| "
                 f"{s['mean_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} "
                 f"({s['worst_row']}); `plan --explain-error ROW` for one row's breakdown")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paraloom plan --explain-error", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--explain-error", required=True, metavar="ROW",
                    help="a published row's name, or `all`")
    ap.add_argument("--json", action="store_true", help="print JSON")
    a = ap.parse_args(argv)
    if a.explain_error == "all":
        rows = validate()
        s = summary(rows)
        print(json.dumps({"rows": rows, "summary": s}, indent=2) if a.json
              else render_all(rows, s))
        return 0
    try:
        r = explain_row(a.explain_error)
    except ValueError as err:
        print(f"paraloom plan: error: {err} (or `all`)", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2) if a.json else render_row(r))
    return 0
