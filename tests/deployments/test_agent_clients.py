"""The clients agents are built with, against a live app with a real model (tests/local_app.py:
SmolLM2-135M-Instruct's real replica behind the gateway's HTTP app, in this process): the OpenAI
Agents SDK (``openai-agents``) running an agent with a function tool over the Responses API, and
LangChain's ``ChatAnthropic`` (over the Messages API) and ``ChatOpenAI`` (over chat completions)
in a tool-calling loop. The tool calls are forced (``tool_choice``), so the 135M model's calls are
valid by the grammar; what is tested is that each client's loop runs: the call reaches the tool,
its result goes back in the client's own format, and the model answers it."""

import asyncio

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_openai_agents_runs_a_function_tool_over_responses(local_app):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would export its traces to OpenAI
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"It is 21 degrees and sunny in {city}."

    client = AsyncOpenAI(base_url=local_app.base_url, api_key="none", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Use the tool, then answer in one sentence.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=local_app.model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
    )
    result = asyncio.run(agents.Runner.run(agent, "What's the weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert calls and all(isinstance(c, str) and c for c in calls)
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds  # the call, then its result sent back
    assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, str) and result.final_output


def test_langchain_chat_anthropic_tool_loop(local_app):
    pytest.importorskip("langchain_anthropic")
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=20, description="the city")  # bounded: the 135M model ends its string

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"It is 21 degrees and sunny in {city}."

    llm = ChatAnthropic(base_url=local_app.root, api_key="none", model=local_app.model, max_tokens=60, max_retries=0)
    question = HumanMessage("What's the weather in Paris?")
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather" and "city" in ai.tool_calls[0]["args"]
    assert ai.response_metadata["stop_reason"] == "tool_use"
    result = get_weather.invoke(ai.tool_calls[0]["args"])
    final = llm.bind_tools([get_weather]).invoke(
        [question, ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    )
    assert final.text() if callable(getattr(final, "text", None)) else final.content
    streamed = [c for c in llm.stream([HumanMessage("Say hello.")])]
    assert streamed and sum(c.usage_metadata["output_tokens"] for c in streamed if c.usage_metadata) > 0
