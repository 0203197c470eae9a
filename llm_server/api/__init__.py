"""HTTP layer: parse and validate, hand work to the service, format JSON or SSE."""
