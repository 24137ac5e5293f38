"""The pipeline stage."""
