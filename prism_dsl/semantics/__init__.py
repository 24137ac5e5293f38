"""The semantics stage."""
