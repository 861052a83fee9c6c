"""pipeline_parallel (see DESIGN.md)."""
