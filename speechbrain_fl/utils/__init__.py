"""Small utilities shared by the recipes (TEMP stub package on the gender branch)."""
