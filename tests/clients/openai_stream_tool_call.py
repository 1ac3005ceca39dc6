"""The openai SDK's streaming helper against thorn: a streamed tool call, accumulated by the SDK.

Usage: python openai_stream_tool_call.py BASE_URL [MODEL]
Prints one JSON object: what the SDK assembled from the stream (its events and final completion) and the
same request's non-streamed answer, for the Rust test to assert on.
"""

import json
import sys

from openai import OpenAI

base = sys.argv[1]
client = OpenAI(api_key="unused", base_url=base + "/v1", max_retries=0, timeout=300)
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    }
]
request = dict(
    model=sys.argv[2] if len(sys.argv) > 2 else client.models.list().data[0].id,
    messages=[{"role": "user", "content": "What's the weather in Paris, in celsius?"}],
    tools=tools,
    tool_choice="required",
    temperature=0,
    max_tokens=64,
)

deltas, done, chunks_with_calls, content = [], [], 0, ""
with client.chat.completions.stream(**request) as stream:
    for event in stream:
        if event.type == "tool_calls.function.arguments.delta":
            deltas.append(event.arguments_delta)
        elif event.type == "tool_calls.function.arguments.done":
            done.append({"name": event.name, "index": event.index, "arguments": event.arguments})
        elif event.type == "chunk":
            if event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                chunks_with_calls += 1
        elif event.type == "content.delta":
            content += event.delta
    final = stream.get_final_completion()

choice = final.choices[0]
plain = client.chat.completions.create(**request)
print(
    json.dumps(
        {
            "argument_deltas": deltas,
            "done": done,
            "chunks_with_calls": chunks_with_calls,
            "streamed_content": content,
            "final_finish_reason": choice.finish_reason,
            "final_calls": [
                {"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
                for c in (choice.message.tool_calls or [])
            ],
            "plain_finish_reason": plain.choices[0].finish_reason,
            "plain_calls": [
                {"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
                for c in (plain.choices[0].message.tool_calls or [])
            ],
        }
    )
)
