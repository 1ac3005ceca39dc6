"""LangChain's ChatOpenAI(...).bind_tools(...) against thorn: a tool call, invoked and streamed.

Usage: python langchain_bind_tools.py BASE_URL
Prints one JSON object of the tool calls LangChain parsed, for the Rust test to assert on.
"""

import json
import sys
import urllib.request

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

base = sys.argv[1]
served = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"21 C in {city}"


llm = ChatOpenAI(model=served, base_url=base + "/v1", api_key="unused", temperature=0, max_tokens=64, max_retries=0)
bound = llm.bind_tools([get_weather], tool_choice="get_weather")
msg = bound.invoke("What's the weather in Paris?")
chunks = list(bound.stream("What's the weather in Paris?"))
acc = chunks[0]
for c in chunks[1:]:
    acc += c
print(
    json.dumps(
        {
            "invoked": [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in msg.tool_calls],
            "streamed": [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in acc.tool_calls],
            "chunks_with_call_parts": sum(1 for c in chunks if c.tool_call_chunks),
            "invalid": [str(c) for c in acc.invalid_tool_calls],
        }
    )
)
