"""`llm-benchmark`: our server vs mlx_lm.server on the same load, plus scoring and the roofline."""
