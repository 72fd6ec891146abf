"""serve layer."""
