"""``python -m paraloom ...`` (what ``torchrun -m paraloom train ...`` runs)."""

from .cli import main
from .launch import exit_process

exit_process(main())
