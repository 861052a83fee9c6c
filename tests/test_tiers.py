"""The two test tiers: ``pytest -m "not slow"`` (the inner loop) leaves out exactly the modules
``conftest.SLOW`` names, each with its reason; ``pytest`` (the README's command, CI) runs all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import SLOW

TESTS = Path(__file__).resolve().parent


def _collected(marker: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "-m", marker, str(TESTS)], capture_output=True,
                          text=True, timeout=300, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line.split("::")[0].rpartition("/")[2] for line in proc.stdout.splitlines()
            if "::" in line}


def test_slow_modules_exist_and_say_why():
    for name, why in SLOW.items():
        assert (TESTS / name).is_file(), name
        assert len(why) > 20, name


def test_quick_tier_leaves_out_exactly_the_slow_modules():
    """One collection (each costs the import of every test module): the quick tier is every
    module on disk but the slow ones, so ``-m slow`` is exactly those."""
    quick = _collected("not slow")
    every = {p.name for p in TESTS.glob("test_*.py")}
    assert "test_tiers.py" in quick and "test_layering.py" in quick
    assert quick == every - set(SLOW), (quick ^ (every - set(SLOW)))
