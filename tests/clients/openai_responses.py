"""The openai SDK's Responses API against thorn: plain text, a required function call and its
function_call_output round (as input items and through previous_response_id), a streamed call whose
argument deltas the SDK accumulates, a custom (freeform) tool as Codex declares apply_patch, called,
streamed and answered with a custom_tool_call_output, a json_schema answer, a thorn: host tool, and an
unknown previous_response_id (a 400).

Usage: python openai_responses.py BASE_URL
Prints one JSON object of what the SDK saw, for the Rust test to assert on.
"""

import json
import sys
import urllib.request

import openai
from openai import OpenAI

base = sys.argv[1]
served = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
weather = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
out = {}

r = client.responses.create(model=served, input="Say hi", max_output_tokens=16, temperature=0)
out["plain"] = {"id": r.id, "status": r.status, "text": r.output_text, "kinds": [o.type for o in r.output],
                "usage": r.usage.model_dump() if r.usage else None}

r = client.responses.create(
    model=served,
    instructions="Answer with the tools you have.",
    input="What's the weather in Paris?",
    tools=[weather],
    tool_choice="required",
    temperature=0,
)
calls = [o for o in r.output if o.type == "function_call"]
out["call"] = {"id": r.id, "calls": [{"name": c.name, "arguments": c.arguments, "call_id": c.call_id} for c in calls]}
c = calls[0]
# The result as input items: the call, then its output.
r2 = client.responses.create(
    model=served,
    instructions="Answer with the tools you have.",
    input=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments},
        {"type": "function_call_output", "call_id": c.call_id, "output": "21 C and sunny"},
    ],
    tools=[weather],
    temperature=0,
    max_output_tokens=48,
)
out["items_round"] = {"status": r2.status, "text": r2.output_text}
# The same through previous_response_id: only the output goes in.
r3 = client.responses.create(
    model=served,
    instructions="Answer with the tools you have.",
    previous_response_id=r.id,
    input=[{"type": "function_call_output", "call_id": c.call_id, "output": "21 C and sunny"}],
    tools=[weather],
    temperature=0,
    max_output_tokens=48,
)
out["previous_round"] = {"status": r3.status, "text": r3.output_text, "previous": r3.previous_response_id}

deltas, kinds = [], []
with client.responses.stream(
    model=served,
    input="What's the weather in Paris?",
    tools=[weather],
    tool_choice="required",
    temperature=0,
) as s:
    for ev in s:
        kinds.append(ev.type)
        if ev.type == "response.function_call_arguments.delta":
            deltas.append(ev.delta)
    final = s.get_final_response()
fc = [o for o in final.output if o.type == "function_call"]
out["stream"] = {"deltas": deltas, "kinds": sorted(set(kinds)), "first": kinds[0], "last": kinds[-1],
                 "final": [{"name": f.name, "arguments": f.arguments} for f in fc]}

# A custom tool (freeform text in), as Codex declares apply_patch.
patch = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /(.|\\n)+/"}}
r = client.responses.create(
    model=served,
    input="Add a line 'hello' to README.md.",
    tools=[patch],
    tool_choice={"type": "custom", "name": "apply_patch"},
    temperature=0,
    max_output_tokens=48,
)
cc = [o for o in r.output if o.type == "custom_tool_call"]
out["custom"] = {"status": r.status, "calls": [{"name": c.name, "input": c.input, "call_id": c.call_id} for c in cc]}
if cc:
    r2 = client.responses.create(
        model=served,
        input=[
            {"role": "user", "content": "Add a line 'hello' to README.md."},
            {"type": "custom_tool_call", "call_id": cc[0].call_id, "name": "apply_patch", "input": cc[0].input},
            {"type": "custom_tool_call_output", "call_id": cc[0].call_id, "output": "Done."},
        ],
        tools=[patch],
        temperature=0,
        max_output_tokens=32,
    )
    out["custom"]["answer"] = r2.output_text
deltas, done = [], None
with client.responses.stream(
    model=served,
    input="Add a line 'hello' to README.md.",
    tools=[patch],
    tool_choice={"type": "custom", "name": "apply_patch"},
    temperature=0,
    max_output_tokens=48,
) as s:
    for ev in s:
        if ev.type == "response.custom_tool_call_input.delta":
            deltas.append(ev.delta)
        elif ev.type == "response.custom_tool_call_input.done":
            done = ev.input
    final = s.get_final_response()
out["custom_stream"] = {"deltas": deltas, "done": done,
                        "final": [o.input for o in final.output if o.type == "custom_tool_call"]}

r = client.responses.create(
    model=served,
    input="Name a city in France.",
    text={"format": {"type": "json_schema", "name": "city", "strict": True, "schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}}},
    temperature=0,
)
out["json"] = r.output_text

r = client.responses.create(
    model=served,
    input="What is 17 * 3?",
    tools=[{"type": "function", "name": "thorn:calculator"}],
    temperature=0,
)
out["host"] = {"text": r.output_text, "extra": (r.model_extra or {}).get("thorn_host_tool_calls")}

try:
    client.responses.create(model=served, input="hi", previous_response_id="resp_nope")
    out["unknown_previous"] = "accepted"
except openai.BadRequestError as e:
    out["unknown_previous"] = {"status": e.status_code, "param": (e.body or {}).get("param")}

print(json.dumps(out))
