"""Reporting edge: tables (CSV + Markdown), figures (PNG), W&B logging and sweep collection."""
