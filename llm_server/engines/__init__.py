"""Engines: the only code that touches arrays (MLX, Core ML)."""
