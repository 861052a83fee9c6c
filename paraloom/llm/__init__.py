"""An OpenAI-compatible model, configured like a Codex provider, and why it does not answer.

``provider`` reads the Codex ``config.toml`` and makes one HTTP request with one deadline;
``ask`` gets one completion for a system and a user text; ``gateway`` finds where an API
answers; ``doctor`` diagnoses a setup that does not work (``paraloom doctor``). Nothing here
knows what is asked: ``explain --ask`` writes the question and checks the answer itself.
"""

from .ask import ask, complete
from .doctor import diagnose
from .provider import (
    EXAMPLE_CONFIG,
    ConfigError,
    DeadlineError,
    Provider,
    ProviderError,
    http,
    is_placeholder,
    load_provider,
)

__all__ = ["Provider", "ProviderError", "ConfigError", "DeadlineError", "EXAMPLE_CONFIG",
           "load_provider", "http", "is_placeholder", "complete", "ask", "diagnose"]
