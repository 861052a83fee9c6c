"""The training progress line, aware of where it is printed.

On a terminal the bar is redrawn in place (``\\r``) every step. Anywhere else (a log file, a pipe,
a CI job, a cluster's job output) a redrawn line would become one line per step, so the bar is
printed as a plain line ten times per run (every ``total // 10`` steps, plus the first and the
last step): a 100,000-step run logs eleven lines, not 100,000.
"""

from __future__ import annotations

import sys

__all__ = ["progress_line", "show_progress"]

WIDTH = 24


def progress_line(step: int, total: int, metrics: dict, tok_s: float) -> str:
    """``[#####.....] step 3/10  loss ...`` for ``step`` (counted from 1) of ``total``."""
    done = int(WIDTH * step / total)
    extra = "".join(f"  {name} {fmt.format(metrics[key])}" for key, name, fmt in (
        ("params_norm", "params_norm", "{:.3f}"), ("num_zeros", "num_zeros", "{:d}"))
        if metrics.get(key) is not None)  # --log-params-norm, --log-num-zeros-in-grad
    return (f"[{'#' * done}{'.' * (WIDTH - done)}] step {step}/{total}  "
            f"loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}{extra}  "
            f"lr {metrics['lr']:.2e}  {tok_s:,.0f} tok/s")


def show_progress(step: int, total: int, metrics: dict, tok_s: float, *, stream=None) -> None:
    """Print the progress of ``step`` (counted from 1): in place on a terminal, else every
    tenth."""
    stream = sys.stdout if stream is None else stream
    last = step >= total
    if stream.isatty():
        stream.write(progress_line(step, total, metrics, tok_s) + ("\n" if last else "\r"))
    elif step == 1 or last or step % max(1, total // 10) == 0:
        stream.write(progress_line(step, total, metrics, tok_s) + "\n")
    else:
        return
    stream.flush()
