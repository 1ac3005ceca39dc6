"""The MCP Python SDK against `thorn serve`'s `/mcp` (Streamable HTTP), as a remote agent would use it.

Usage: mcp_http.py URL KEY ROBOT_KEY NEW_WASM PLUGINS_DIR NEW_POLICY POLICY

KEY may use every tool, ROBOT_KEY only the calculator. Partway through, the script installs NEW_WASM into
PLUGINS_DIR and moves NEW_POLICY (which approves it) over POLICY, as an operator would while the server
runs, and waits for both of its sessions to be told the tool list changed. Prints what it saw as JSON.
"""

import asyncio
import json
import os
import shutil
import sys

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def dump(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def transport(url, key):
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {key}"})
    return streamable_http_client(url, http_client=http)


async def error_of(call):
    try:
        result = await call
        return {"result": dump(result)}
    except Exception as e:  # the SDK's MCPError
        return {"error": type(e).__name__ + ": " + str(e)}


async def raw(url, key, extra):
    """Status and body of a bare initialize POST with `extra` headers (the guards in front of rmcp)."""
    headers = dict(ACCEPT)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    headers.update(extra)
    async with httpx2.AsyncClient() as c:
        r = await c.post(url, json=INIT, headers=headers)
        return {"status": r.status_code, "body": r.text[:300]}


async def too_large(url, key):
    """A body over the server's --max-body."""
    headers = dict(ACCEPT)
    headers["Authorization"] = f"Bearer {key}"
    body = dict(INIT)
    body["params"] = dict(INIT["params"], padding="x" * 200_000)
    async with httpx2.AsyncClient() as c:
        r = await c.post(url, json=body, headers=headers)
        return {"status": r.status_code, "body": r.text[:300]}


async def main():
    url, key, robot, new_wasm, plugins_dir, new_policy, policy = sys.argv[1:8]
    out = {}
    out["no_key"] = await raw(url, None, {})
    out["wrong_key"] = await raw(url, "nope", {})
    out["evil_origin"] = await raw(url, key, {"Origin": "http://evil.example"})
    out["evil_host"] = await raw(url, key, {"Host": "evil.example"})
    out["good_raw"] = await raw(url, key, {})
    out["too_large"] = await too_large(url, key)

    legacy_notes = []

    async def on_message(message):
        if not isinstance(message, Exception):
            legacy_notes.append(type(message.root if hasattr(message, "root") else message).__name__)

    # A 2025-11-25 session (initialize handshake, Mcp-Session-Id) with the full key.
    async with Client(transport(url, key), mode="legacy", cache=None, message_handler=on_message) as full:
        out["legacy_version"] = full.session.protocol_version if hasattr(full.session, "protocol_version") else None
        out["tools"] = {t.name: dump(t) for t in (await full.list_tools()).tools}
        out["call"] = dump(await full.call_tool("evaluate", {"expression": "17 * 3"}))
        out["bad_arguments"] = dump(await full.call_tool("evaluate", {"expression": 17}))
        out["unknown"] = await error_of(full.call_tool("no_such_tool", {}))

        # A 2026-07-28 client (no sessions) with the robot's key: only the calculator is its to use.
        async with Client(transport(url, robot), mode="2026-07-28", cache=None) as bot:
            out["robot_tools"] = sorted(t.name for t in (await bot.list_tools()).tools)
            out["robot_denied"] = await error_of(bot.call_tool("read_file", {"path": "notes.txt"}))
            out["robot_call"] = dump(await bot.call_tool("evaluate", {"expression": "2 ^ 10"}))

            # The operator installs and approves a plugin while both are connected.
            async with bot.listen(tools_list_changed=True) as sub:
                out["listen_honored"] = str(getattr(sub, "honored", None))
                shutil.copy(new_wasm, os.path.join(plugins_dir, os.path.basename(new_wasm)))
                os.replace(new_policy, policy)
                with anyio.fail_after(120):
                    async for event in sub:
                        out["modern_event"] = type(event).__name__
                        break
            with anyio.fail_after(120):
                while not any("ToolListChanged" in n for n in legacy_notes):
                    await anyio.sleep(0.1)
            out["legacy_notes"] = legacy_notes
            out["robot_tools_after"] = sorted(t.name for t in (await bot.list_tools()).tools)
        out["tools_after"] = sorted(t.name for t in (await full.list_tools()).tools)
        out["new_call"] = dump(await full.call_tool("convert", {"value": 1, "from": "km", "to": "m"}))
    print(json.dumps(out))


asyncio.run(main())
