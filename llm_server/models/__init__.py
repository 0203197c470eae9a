"""Many models in one daemon: the registry file, the memory budget, loading on demand."""
