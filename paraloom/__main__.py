"""``python -m paraloom ...`` (what ``torchrun -m paraloom train ...`` runs)."""

import sys

from .cli import main

sys.exit(main())
