"""The `curl` example `make demo` and `make demo-cell` print pastes as one command.

The printed lines go to bash as a person pastes them: `bash -n` parses them, and bash runs
them with `curl` defined as a function that records its arguments, so the test sees exactly
one curl, with both headers and the body, and no second command (the old two bare lines ran
a GET and then "-H: command not found").
"""

from __future__ import annotations

import inspect
import json
import shlex
import subprocess

from appliance.testing import demo, demo_cell
from appliance.testing.demo_curl import curl_example

KEY = "sk-demo-0123456789abcdef"
URL = "http://127.0.0.1:8001"


def test_the_printed_curl_is_one_command_with_its_headers_and_body() -> None:
    pasted = "\n".join(curl_example(URL, KEY)) + "\n"
    parsed = subprocess.run(["bash", "-n"], input=pasted, text=True, capture_output=True,
                            check=False, timeout=30)
    assert parsed.returncode == 0, parsed.stderr
    recorder = "curl() { echo CURL; printf '%s\\n' \"$@\"; }\n"
    ran = subprocess.run(["bash", "-e"], input=recorder + pasted, text=True,
                         capture_output=True, check=False, timeout=30)
    assert ran.returncode == 0 and not ran.stderr, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines.count("CURL") == 1
    args = lines[1:]
    assert args[0] == f"{URL}/v1/chat/completions"
    assert args[1:5] == ["-H", f"Authorization: Bearer {KEY}", "-H",
                         "Content-Type: application/json"]
    assert args[5] == "-d" and json.loads(args[6])["model"] == "kimi-k3"
    words = shlex.split(pasted.replace("\\\n", " "))
    assert words.count("curl") == 1 and words.count("-H") == 2


def test_both_demos_print_that_example() -> None:
    for module in (demo, demo_cell):
        source = inspect.getsource(module)
        assert "*curl_example(" in source and "curl {" not in source, module.__name__
