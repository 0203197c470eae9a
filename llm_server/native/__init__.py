"""The Linux-CPU kernel set (cpu_set.py) and the native code behind it: decode ops, skinny
products, the JIT flags, numpy paths. Never imports llm_server.engines."""
