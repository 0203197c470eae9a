"""OpenAI Responses: POST /v1/responses and GET/DELETE /v1/responses/{id}, as adapters onto
the chat path (input items, tools, output items, the stored responses)."""
