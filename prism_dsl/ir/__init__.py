"""The ir stage."""
