"""Reading parallel-training source code: ``paraloom explain`` (SPEC.md "Reading source code").

The reader never imports or runs the code. ``source`` loads the snippet, ``static`` finds the
communication sites (walked by ``walker`` with ``module``, ``resolve``, ``names``, ``calls``,
``callsites``, ``constants``, ``spellings`` and ``rules``; the values along each path by
``scope``, ``expressions`` and ``conditions``; ``presets`` names framework settings),
``facts`` the world sizes, partitions and local weights,
``answers`` the checklist answers and the order table, ``reading`` puts them together
(:func:`explain`, :func:`to_json`), ``run`` marks the sites with what a recorded run did there,
and ``grounding`` writes the question for ``--ask`` and checks the model's answer against the
facts. Everything here is data; the text report is :mod:`paraloom.report.explain_text`, the
model is asked through :mod:`paraloom.llm`, the command line is :mod:`paraloom.commands.explain`.
"""

from .grounding import SYSTEM, contradictions, question
from .reading import explain, to_json
from .run import annotate, parse_site
from .source import Snippet, SourceError, load_snippet

__all__ = ["explain", "to_json", "annotate", "parse_site", "Snippet", "SourceError",
           "load_snippet", "SYSTEM", "question", "contradictions"]
