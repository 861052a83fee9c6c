"""Reports from a run folder: the communication order table (:mod:`.table`), the Perfetto trace
(:mod:`.trace`), the pictures (:mod:`.plots`: schedule and loss, matplotlib imported only when
drawn; :mod:`.expert_load`; :mod:`.svg`), the one-page HTML report (:mod:`.html`, from
:mod:`.sections`, :mod:`.sources` and the inline ``assets/``), the text of ``paraloom explain``
(:mod:`.explain_text`), and the one writer of a run's reports (:mod:`.run_reports`).
"""

from .table import render_table, table_rows
from .trace import build_trace, write_trace

__all__ = ["render_table", "table_rows", "build_trace", "write_trace"]
