"""The `curl` example `make demo` and `make demo-cell` print: one command a person can paste.

Its lines end in a backslash, so a terminal given the block runs one `curl` with both headers
and the body; printed as two bare lines it ran a GET and then "-H: command not found".
"""

from __future__ import annotations

import json

INDENT = " " * 12  # the banner's column for an example under its heading
BODY = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}


def curl_example(gateway_url: str, key: str) -> list[str]:
    """The example's lines, indented for the banner, each but the last continued with " \\"."""
    parts = [f"curl {gateway_url}/v1/chat/completions",
             f"-H 'Authorization: Bearer {key}'",
             "-H 'Content-Type: application/json'",
             f"-d '{json.dumps(BODY)}'"]
    lines = [INDENT + parts[0]] + [INDENT + "     " + part for part in parts[1:]]
    return [line + " \\" for line in lines[:-1]] + [lines[-1]]
