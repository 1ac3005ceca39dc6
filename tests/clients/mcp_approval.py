"""An MCP client that answers elicitation: `thorn mcp` asks it to approve a held tool call.

Usage: mcp_approval.py THORN PLUGINS POLICY. The first elicitation is accepted (approve), the second
declined; a second session that declares no elicitation support gets its held call denied when its time
runs out. Prints what it saw as JSON (the test asserts on it).
"""

import asyncio
import json
import sys

from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client


def dump(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def main():
    thorn, plugins, policy = sys.argv[1:4]
    server = StdioServerParameters(
        command=thorn, args=["mcp", "--plugins", plugins, "--policy", policy, "--conversation", "mcp-approval"]
    )
    out = {"asked": []}
    answers = iter([True, False])

    async def elicit(context, params):
        out["asked"].append(dump(params))
        if next(answers, False):
            return types.ElicitResult(action="accept", content={"approve": True})
        return types.ElicitResult(action="decline")

    async with stdio_client(server) as (read, write):
        async with ClientSession(read, write, elicitation_callback=elicit) as session:
            await session.initialize()
            out["approved"] = dump(await session.call_tool("move_joints", {"base": 10}))
            out["declined"] = dump(await session.call_tool("move_joints", {"base": 20}))
            # Read-only: never held.
            out["state"] = dump(await session.call_tool("arm_state", {}))
    async with stdio_client(server) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            out["unasked"] = dump(await session.call_tool("move_joints", {"base": 30}))
    print(json.dumps(out))


asyncio.run(main())
