"""DP teacher helpers and offline distillation (Private-Gender recipe): not implemented yet."""
