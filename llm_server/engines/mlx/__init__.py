"""The MLX engine and its parts: loading, the step executor, decode pipelining, sessions."""
