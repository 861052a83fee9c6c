"""analysis (see DESIGN.md)."""
