"""A real agent framework (openai-agents, Chat Completions model) runs a tool against the server.

The first turn forces a call (`tool_choice` required, valid by construction); the agent runs
the Python tool with the model's arguments and stops on it.
"""

from __future__ import annotations

import asyncio


def test_openai_agents_runs_a_tool_with_valid_arguments(hermes_server):
    from agents import (  # openai-agents, in the dev extra
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace upload
    ran: list[tuple[str, int]] = []

    @function_tool
    def get_forecast(city: str, days: int) -> str:
        """The weather forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        ran.append((city, days))
        return f"{days} days of sun in {city}"

    client = AsyncOpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the forecast tool.",
        model=OpenAIChatCompletionsModel(model="default", openai_client=client),
        tools=[get_forecast],
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120),
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris for two days?"))
    assert len(ran) == 1
    city, days = ran[0]
    assert isinstance(city, str) and isinstance(days, int) and not isinstance(days, bool)
    assert result.final_output == f"{days} days of sun in {city}"
