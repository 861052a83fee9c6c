"""Reports from a run's ledger: the communication order table and the Perfetto trace.

(``plots.py``, the pipeline schedule picture, lives here too and is imported on its own: it
needs matplotlib.)

``html.py`` (``paraloom report``: the run's one self-contained HTML page, from ``sections.py``,
``svg.py``, ``sources.py`` and the inline ``assets/``) is imported on its own too.
"""

from .table import render_table, table_main, table_rows
from .trace import build_trace, trace_main, write_trace

__all__ = ["render_table", "table_main", "table_rows", "build_trace", "trace_main",
           "write_trace"]
