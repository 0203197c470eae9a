"""What every route shares: the app state, error bodies, body reading and admission, the
sampling and tool fields, the chat and completion request objects, streaming, metrics, the
API key and the request log. Imports nothing else of api/."""
