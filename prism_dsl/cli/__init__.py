"""The cli stage."""
