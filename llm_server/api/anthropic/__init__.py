"""Anthropic Messages: POST /v1/messages and /v1/messages/count_tokens, an adapter onto the chat
path (the request's fields, system messages, content blocks and Anthropic's error body)."""
