"""The prove stage."""
