"""``python -m paraloom ...`` (what ``torchrun -m paraloom train ...`` runs)."""

from .commands import main
from .launch import exit_process

exit_process(main())
