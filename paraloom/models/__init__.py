"""models (see DESIGN.md)."""
