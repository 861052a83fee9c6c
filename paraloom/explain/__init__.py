"""Reading parallel-training source code: ``paraloom explain`` and ``paraloom doctor``.

``static`` finds the communication sites, ``facts`` the world sizes, partitions and local
weights, ``answers`` the checklist answers and the order table, ``llm`` / ``doctor`` the optional
OpenAI-compatible provider (see SPEC.md "Reading source code").
"""

from .command import doctor_main, explain, explain_main, render, to_json

__all__ = ["explain", "render", "to_json", "explain_main", "doctor_main"]
