"""The lang stage."""
