"""The progress display: in place on a terminal, a line per tenth of the run elsewhere."""

from __future__ import annotations

import io

from paraloom.training.progress import progress_line, show_progress

METRICS = {"loss": 2.5, "grad_norm": 0.5, "lr": 3e-4}


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _run(total: int, tty: bool) -> str:
    out = _Stream(tty)
    for step in range(1, total + 1):
        show_progress(step, total, METRICS, 1000.0, stream=out)
    return out.getvalue()


def test_not_a_terminal_prints_eleven_lines_for_a_long_run():
    text = _run(1000, tty=False)
    lines = text.splitlines()
    assert "\r" not in text
    assert len(lines) == 11  # the first step, then every 100th (the 1000th is the last)
    assert lines[0].startswith("[") and "step 1/1000" in lines[0]
    assert "step 100/1000" in lines[1] and "step 1000/1000" in lines[-1]


def test_short_run_off_terminal_prints_every_step():
    assert len(_run(5, tty=False).splitlines()) == 5  # total // 10 == 0: every step


def test_terminal_redraws_in_place_and_ends_with_a_newline():
    text = _run(50, tty=True)
    assert text.count("\r") == 49 and text.count("\n") == 1 and text.endswith("\n")
    assert text.rsplit("\r", 1)[-1] == progress_line(50, 50, METRICS, 1000.0) + "\n"
