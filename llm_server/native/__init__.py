"""C code the Linux CPU path preloads (see `llm_server.native.skinny`)."""
