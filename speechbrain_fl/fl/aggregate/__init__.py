"""Aggregation: the rules, registered by name, the validated client update they read, what an
aggregated round reports, and the global model's step."""
