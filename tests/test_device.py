"""What paraloom sets up per process for a rank's device: glibc's allocator thresholds."""

from __future__ import annotations


def test_allocator_tuning_applies_on_glibc_and_can_be_refused(monkeypatch):
    """tune_allocator raises glibc's mmap/trim thresholds (paraloom train's ranks); the
    environment can refuse it. Run in a child process: the setting is process-wide."""
    import platform
    import subprocess
    import sys

    code = "from paraloom.device import tune_allocator; print(tune_allocator())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PARALOOM_MALLOC_TUNING": "0"})
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert on.stdout.strip().splitlines()[-1] == str(glibc)
    assert off.stdout.strip().splitlines()[-1] == "False"
