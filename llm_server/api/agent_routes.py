"""The routes of the APIs coding agents speak: OpenAI Responses and Anthropic Messages."""

from __future__ import annotations

from starlette.routing import Route

from llm_server.api.anthropic.messages import count_tokens, create_message
from llm_server.api.openai.responses.routes import create_response, delete_response, get_response

AGENT_ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
