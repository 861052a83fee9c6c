"""Where the installed megatron-core source files are, without importing megatron.

megatron-core 0.19.2 is installed for its source text only (it declares Python >= 3.12 and
pulls heavy dependencies, so pip cannot express it as a plain extra):

    .venv/bin/pip install --no-deps --ignore-requires-python megatron-core==0.19.2

(see README.md's test command and .ci/run).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

VERSION = "0.19.2"
INSTALL = (f"pip install --no-deps --ignore-requires-python megatron-core=={VERSION}")


def megatron_file(relative: str) -> Path:
    """The installed ``megatron/core/<relative>``; raises with the install command if absent."""
    try:
        dist = metadata.distribution("megatron-core")
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"megatron-core is not installed; run: {INSTALL}") from None
    if dist.version != VERSION:
        raise FileNotFoundError(f"megatron-core {dist.version} installed, tests read "
                                f"{VERSION}; run: {INSTALL}")
    path = Path(dist.locate_file(f"megatron/core/{relative}"))
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from megatron-core {dist.version}")
    return path
