"""Small data tables shipped with the package (no weights, no hub access needed)."""
