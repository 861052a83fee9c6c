"""data_parallel (see DESIGN.md)."""
