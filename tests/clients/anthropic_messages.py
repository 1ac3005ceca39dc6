"""The anthropic SDK against thorn's Messages API: tools streamed and not, count_tokens, a host tool, errors.

This SDK version no longer has `temperature` (Anthropic's API dropped it); thorn still takes it, sent
through `extra_body` so the greedy answers are reproducible.

Usage: python anthropic_messages.py BASE_URL
Prints one JSON object of what the SDK received, for the Rust test to assert on.
"""

import json
import sys

import anthropic

base = sys.argv[1]
client = anthropic.Anthropic(api_key="unused", base_url=base, max_retries=0, timeout=300)
served = json.loads(__import__("urllib.request").request.urlopen(base + "/v1/models").read())["data"][0]["id"]
weather = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ask = [{"role": "user", "content": "What's the weather in Paris?"}]
out = {}

# Not streamed: a forced tool call comes back as a tool_use block.
m = client.messages.create(
    model=served, max_tokens=64, extra_body={"temperature": 0}, tools=[weather], tool_choice={"type": "any"}, messages=ask
)
out["plain"] = {
    "stop_reason": m.stop_reason,
    "blocks": [b.to_dict() for b in m.content],
    "usage": m.usage.to_dict(),
}

# Streamed: the SDK's helper accumulates input_json_delta fragments into the same tool_use block.
fragments, texts = [], []
with client.messages.stream(
    model=served, max_tokens=64, extra_body={"temperature": 0}, tools=[weather], tool_choice={"type": "any"}, messages=ask
) as s:
    for ev in s:
        if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
            fragments.append(ev.delta.partial_json)
        elif ev.type == "content_block_delta" and ev.delta.type == "text_delta":
            texts.append(ev.delta.text)
    final = s.get_final_message()
out["stream"] = {
    "fragments": fragments,
    "texts": texts,
    "stop_reason": final.stop_reason,
    "blocks": [b.to_dict() for b in final.content],
}

# The tool's result goes back as a tool_result block and the model answers in text.
call = m.content[-1]
follow = client.messages.create(
    model=served,
    max_tokens=32,
    extra_body={"temperature": 0},
    tools=[weather],
    messages=ask
    + [
        {"role": "assistant", "content": [b.to_dict() for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C and sunny"}],
        },
    ],
)
out["follow"] = {"stop_reason": follow.stop_reason, "types": [b.type for b in follow.content]}

# Plain text, streamed, with a system prompt and a stop sequence.
with client.messages.stream(
    model=served, max_tokens=24, extra_body={"temperature": 0}, system="You are terse.", messages=[{"role": "user", "content": "Count: one, two, three, four, five"}]
) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
out["text"] = {"text": text, "stop_reason": final.stop_reason, "final_text": final.content[0].text if final.content else None}

# A stop sequence ends the message and is named (any reply of several words has a space).
stopped = client.messages.create(
    model=served, max_tokens=24, extra_body={"temperature": 0}, stop_sequences=[" "],
    messages=[{"role": "user", "content": "Say hello to the whole world."}],
)
out["stopped"] = {"stop_reason": stopped.stop_reason, "stop_sequence": stopped.stop_sequence}

# count_tokens counts what create would prompt with.
out["count"] = client.messages.count_tokens(model=served, tools=[weather], messages=ask).input_tokens

# A host tool: thorn runs the calculator inside the request; streamed events stay readable by the SDK.
host_request = dict(
    model=served,
    max_tokens=200,
    extra_body={"temperature": 0},
    tools=[{"name": "thorn:calculator"}],
    tool_choice={"type": "any"},
    messages=[{"role": "user", "content": "What is 17 * 3?"}],
)
with client.messages.stream(**host_request) as s:
    kinds = [ev.type for ev in s]
    host_final = s.get_final_message()
out["host"] = {"events": sorted(set(kinds)), "stop_reason": host_final.stop_reason}
host_plain = client.messages.create(**host_request)
out["host_plain"] = host_plain.to_dict()

# Errors arrive as the SDK's typed exceptions.
errors = {}
try:
    client.messages.create(model="no-such-model", max_tokens=8, messages=ask)
except anthropic.NotFoundError as e:
    errors["model"] = [e.status_code, e.body["error"]["type"]]
try:
    client.messages.create(model=served, max_tokens=8, messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
except anthropic.BadRequestError as e:
    errors["image"] = [e.status_code, e.body["error"]["type"], e.body["error"]["message"]]
out["errors"] = errors
print(json.dumps(out))
