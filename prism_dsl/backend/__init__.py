"""The backend stage."""
