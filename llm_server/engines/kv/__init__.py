"""Per-row KV and recurrent state, the row table, the prefix cache and its disk tier."""
