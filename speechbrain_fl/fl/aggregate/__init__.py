"""Aggregation rules, registered by name, and the validated client update they read."""
