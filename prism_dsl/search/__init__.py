"""The search stage."""
