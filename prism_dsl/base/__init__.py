"""The base stage."""
