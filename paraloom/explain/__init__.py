"""explain (see DESIGN.md)."""
