"""Demo traffic: a few pretend users chatting through the gateway, so the demo's Usage page,
rewrite rates and Tuning page's observed workload have something to show. A test and demo
instrument (`make demo` starts it as a child process); production never runs it.

`python -m appliance.testing.demo_traffic URL KEYFILE`: KEYFILE is the demo's JSON
{name: key}. Each user holds a conversation and sends a turn every few seconds: "chat"
appends to its history as clients should; "agent" streams and appends too, with usage asked
for; "summariser" keeps a sliding window of the last turns, i.e. rewrites its history (the
habit the Usage page flags). While the engine is not ready the gateway's 503 and its
Retry-After are honoured.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "kimi-k3"
PROMPTS = ("summarise the weights page", "what is the memory ratio", "explain state slots",
           "how long does a start take", "write a haiku about GPUs", "list three risks",
           "and why is that", "give an example", "shorter please", "thanks, one more")


def turn(http: httpx.Client, key: str, history: list[dict[str, Any]], *, stream: bool) -> float:
    """One chat turn; returns how long to wait before the next (Retry-After on 429/503)."""
    history.append({"role": "user", "content": random.choice(PROMPTS)})  # noqa: S311
    body: dict[str, Any] = {"model": MODEL, "messages": history,
                            "max_tokens": random.randint(16, 64)}  # noqa: S311
    headers = {"Authorization": f"Bearer {key}"}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        text = []
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
            if reply.status_code != 200:
                reply.read()
                history.pop()
                return float(reply.headers.get("retry-after", 5))
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        text.append(choice.get("delta", {}).get("content") or "")
        history.append({"role": "assistant", "content": "".join(text)})
        return 0.0
    reply = http.post("/v1/chat/completions", json=body, headers=headers)
    if reply.status_code != 200:
        history.pop()
        return float(reply.headers.get("retry-after", 5))
    history.append(reply.json()["choices"][0]["message"])
    return 0.0


def main(argv: list[str]) -> int:
    url, keyfile = argv[1], Path(argv[2])
    keys: dict[str, str] = json.loads(keyfile.read_text())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C in the demo's terminal reaches this child too: end as quietly as on SIGTERM
    # (the demo says what stopped), not with a traceback.
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    system = {"role": "system", "content": "You are the appliance's demo assistant."}
    histories: dict[str, list[dict[str, Any]]] = {name: [system] for name in keys}
    with httpx.Client(base_url=url, timeout=120) as http:
        while True:
            name = random.choice(sorted(keys))  # noqa: S311
            history = histories[name]
            if len(history) > 16:
                history[:] = [system]  # a new conversation
            try:
                wait = turn(http, keys[name], history, stream=name == "agent")
            except httpx.HTTPError:
                wait = 5.0
            if name == "summariser" and len(history) > 5:
                del history[1:3]  # a sliding window: the oldest turn goes
            time.sleep(min(30.0, max(wait, random.uniform(0.5, 2.5))))  # noqa: S311


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
