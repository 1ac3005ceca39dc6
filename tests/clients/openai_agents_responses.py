"""The openai-agents SDK's default model class (OpenAIResponsesModel: the Responses API) runs an agent
with a function tool against thorn.

Usage: python openai_agents_responses.py BASE_URL
Its first model turn must call the tool (tool_choice "required"; the SDK resets it after a call, so the
next turn may answer). Prints one JSON object of what the SDK saw, for the Rust test to assert on.
"""

import asyncio
import json
import sys
import urllib.request

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

base = sys.argv[1]
served = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
set_tracing_disabled(True)
calls = []


@function_tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    calls.append(city)
    return f"21 C and sunny in {city}"


async def main() -> dict:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = Agent(
        name="weather",
        instructions="Answer with the tools you have.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=served, openai_client=client),
        model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=64),
    )
    r = await Runner.run(agent, "What's the weather in Paris?", max_turns=4)
    out = {"plain": {"calls": list(calls), "items": [i.type for i in r.new_items], "final": r.final_output}}
    calls.clear()
    s = Runner.run_streamed(agent, "What's the weather in Paris?", max_turns=4)
    kinds = []
    async for ev in s.stream_events():
        kinds.append(ev.type if ev.type != "run_item_stream_event" else "item:" + ev.item.type)
    out["stream"] = {"calls": list(calls), "events": sorted(set(kinds)), "final": s.final_output}
    return out


print(json.dumps(asyncio.run(main())))
