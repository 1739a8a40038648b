"""Secure aggregation: Flower's SecAgg+ for the train stage, and layer-wise aggregation under it."""
