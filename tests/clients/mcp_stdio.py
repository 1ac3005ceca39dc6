"""The MCP Python SDK as a desktop agent would use it: `thorn mcp` started as a child process over stdio.

Usage: mcp_stdio.py THORN PLUGINS POLICY. Prints what it received as JSON (the test asserts on it).
"""

import asyncio
import json
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


def dump(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def main():
    thorn, plugins, policy = sys.argv[1:4]
    server = StdioServerParameters(
        command=thorn, args=["mcp", "--plugins", plugins, "--policy", policy, "--conversation", "mcp-test"]
    )
    out = {}
    async with stdio_client(server) as (read, write):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            out["server"] = dump(init)["serverInfo"]
            listed = await session.list_tools()
            out["tools"] = {t.name: dump(t) for t in listed.tools}
            out["call"] = dump(await session.call_tool("evaluate", {"expression": "17 * 3"}))
            # A schema violation never reaches the plugin: an error result the model can read.
            out["bad_arguments"] = dump(await session.call_tool("evaluate", {"expression": 17}))
            # The plugin's own failure (a timeout under its policy) is an error result too.
            out["timeout"] = dump(await session.call_tool("spin", {"n": 3}))
            # A tool no plugin has is a protocol error.
            try:
                await session.call_tool("no_such_tool", {})
                out["unknown"] = "no error"
            except Exception as e:  # the SDK's McpError
                out["unknown"] = type(e).__name__ + ": " + str(e)
            # The server still serves after all of that.
            out["after"] = dump(await session.call_tool("evaluate", {"expression": "2 ^ 10"}))
    print(json.dumps(out))


asyncio.run(main())
