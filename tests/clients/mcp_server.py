"""An external MCP server written with the MCP Python SDK, for thorn to consume over stdio.

Usage: mcp_server.py [LOG] [--http PORT_FILE TOKEN]. Each start appends a line to LOG (when given), so a
test can count restarts. With --http it serves Streamable HTTP at http://127.0.0.1:<port>/mcp instead of
stdio, on a free port it writes to PORT_FILE, and answers 401 to a request without `Bearer TOKEN`.
Tools:
- forecast(city): a well-behaved tool with structured output;
- secret(): a tool the test policy does not allow (it must never be shown or called);
- fail(): reports a tool error (isError);
- huge(kib): returns a result of about `kib` KiB;
- hang(): never returns;
- garbage(): writes a line of non-JSON-RPC to stdout, then exits (a server speaking malformed JSON-RPC
  and dying);
- files(): exists so that a server named `list` clashes with the files plugin's `list_files`;
- picky(code): its schema uses `not`, which the decoding grammar cannot take.
"""

import os
import sys
import time

from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import BaseModel, Field

args = sys.argv[1:]
http = None
if "--http" in args:
    i = args.index("--http")
    http = (args[i + 1], args[i + 2])
    del args[i : i + 3]
if args:
    with open(args[0], "a") as f:
        f.write(f"start {os.getpid()}\n")

server = MCPServer("weather-test")


class Forecast(BaseModel):
    city: str
    temp_c: float
    sky: str


@server.tool()
def forecast(city: str) -> Forecast:
    """Tomorrow's weather forecast for a city: temperature in Celsius and the sky."""
    return Forecast(city=city, temp_c=21.5, sky="clear")


@server.tool()
def secret() -> str:
    """Something the operator did not allow."""
    return "the secret"


@server.tool()
def fail(reason: str = "no reason") -> str:
    """Always fails."""
    raise ValueError(f"the tool failed: {reason}")


@server.tool()
def huge(kib: int) -> str:
    """Returns about `kib` KiB of text."""
    return "x" * (kib * 1024)


@server.tool()
def hang() -> str:
    """Never returns."""
    while True:
        time.sleep(1)


@server.tool()
def garbage() -> str:
    """Writes malformed JSON-RPC to stdout and exits."""
    sys.stdout.write("this is not JSON-RPC {{{\n")
    sys.stdout.flush()
    os._exit(3)


@server.tool()
def files() -> str:
    """Named so that a server called `list` clashes with `list_files`."""
    return "files"


@server.tool()
def picky(code: Annotated[str, Field(json_schema_extra={"not": {"const": "0000"}})]) -> str:
    """Takes any code but 0000."""
    return code


def serve_http(port_file, token):
    import socket

    import uvicorn

    app = server.streamable_http_app()

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            if auth != f"Bearer {token}":
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"bad token"})
                return
        await app(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    uvicorn.Server(uvicorn.Config(guarded, log_level="warning")).run(sockets=[sock])


if http:
    serve_http(*http)
else:
    server.run("stdio")
