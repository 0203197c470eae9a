"""The OpenAI-compatible routes: chat completions, completions, embeddings, Responses."""
