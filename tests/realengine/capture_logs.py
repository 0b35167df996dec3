"""Capture real SGLang 0.5.23 CPU logs into tests/data/sglang-cpu/ (run by hand, not by pytest).

    .venv/bin/python -m tests.realengine.capture_logs [ENV] [OUT]

ENV defaults to the built env (tests/realengine/build-env.sh --where); OUT to
tests/data/sglang-cpu. Each scenario starts the real engine with the tier's fixed fake key
(FAKE_ENGINE_KEY), so no real secret can reach a log; the temporary model folders are
written as /tmp/realengine/<kind>-model in the files so a re-capture diffs cleanly. What
each scenario did and how the engine exited is in OUT/scenarios.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.realengine.fixtures import (
    DENSE_CPU_ARGS,
    FAKE_ENGINE_KEY,
    HYBRID_CPU_ARGS,
    NO_GENERATION_ARGS,
    NO_GENERATION_ENV,
    RealEngine,
    env_where,
    make_model,
)

OUT = Path(__file__).resolve().parent.parent / "data" / "sglang-cpu"
READY_LINE = "The server is fired up and ready to roll!"


def _stream(engine: RealEngine, first_chunk: threading.Event, result: dict[str, Any]) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}
    chunks = 0
    try:
        with httpx.stream("POST", f"{engine.base_url}/v1/chat/completions", json=body,
                          headers=engine.headers(), timeout=120) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    first_chunk.set()
                    if line == "data: [DONE]":
                        result["done"] = True
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
    finally:
        result["chunks"] = chunks
        first_chunk.set()


def dense_ready(engine: RealEngine) -> dict[str, Any]:
    engine.wait_healthy()
    engine.wait_log(READY_LINE)
    return {"what": "a dense start to READY (the log cut after the ready line)",
            "cut_after": READY_LINE}


def dense_drain(engine: RealEngine) -> dict[str, Any]:
    engine.wait_healthy()
    engine.wait_log(READY_LINE)
    first_chunk = threading.Event()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=_stream, args=(engine, first_chunk, result))
    thread.start()
    first_chunk.wait(120)
    engine.terminate()
    code = engine.wait_exit()
    thread.join(120)
    return {"what": "a dense start, a stream in flight, SIGTERM: the drain", "exit": code,
            "stream": result}


def dense_no_drain(engine: RealEngine) -> dict[str, Any]:
    seen = engine.wait_healthy()
    engine.terminate()
    return {"what": "--skip-server-warmup, health generation off, only /health ever called, "
                    "then SIGTERM",
            "health_codes": seen, "exit": engine.wait_exit()}


def hybrid_no_generation(engine: RealEngine) -> dict[str, Any]:
    seen = engine.wait_healthy()
    info = httpx.get(f"{engine.base_url}/server_info", headers=engine.headers(), timeout=30)
    engine.terminate()
    keys = ("mamba_full_memory_ratio", "max_mamba_cache_size", "mamba_radix_cache_strategy")
    return {"what": "the tiny Kimi-Linear in no-generation mode, then SIGTERM",
            "health_codes": seen, "exit": engine.wait_exit(),
            "server_info": {k: info.json().get(k) for k in keys}}


def hybrid_crash(engine: RealEngine) -> dict[str, Any]:
    engine.wait_healthy()
    try:
        response = httpx.post(f"{engine.base_url}/generate", headers=engine.headers(),
                              json={"text": "hello", "sampling_params": {"max_new_tokens": 4}},
                              timeout=120)
        answer: Any = response.status_code
    except httpx.HTTPError as exc:
        answer = repr(exc)
    return {"what": "the tiny Kimi-Linear's first forward (a /generate): the crash",
            "generate": answer, "exit": engine.wait_exit()}


SCENARIOS: dict[str, tuple[str, tuple[str, ...], dict[str, str],
                           Callable[[RealEngine], dict[str, Any]]]] = {
    "dense-ready": ("dense", (), {}, dense_ready),
    "dense-drain": ("dense", (), {}, dense_drain),
    # /health runs a generation by default, which installs SGLang's drain: only with
    # health generation off does no request ever reach the engine.
    "dense-no-drain": ("dense", NO_GENERATION_ARGS, NO_GENERATION_ENV, dense_no_drain),
    "hybrid-no-generation": ("hybrid", HYBRID_CPU_ARGS + NO_GENERATION_ARGS, NO_GENERATION_ENV,
                             hybrid_no_generation),
    "hybrid-crash": ("hybrid", HYBRID_CPU_ARGS + NO_GENERATION_ARGS, NO_GENERATION_ENV,
                     hybrid_crash),
}


def main(argv: list[str]) -> None:
    env = Path(argv[0]) if argv else env_where()[0]
    out = Path(argv[1]) if len(argv) > 1 else OUT
    only = set(argv[2:])
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "scenarios.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        models = {kind: make_model(env, kind, root / f"{kind}-model") for kind in ("dense",
                                                                                  "hybrid")}
        for name, (kind, extra, extra_env, run) in SCENARIOS.items():
            if only and name not in only:
                continue
            log = out / f"{name}.log"
            args = extra if kind == "hybrid" else DENSE_CPU_ARGS + extra
            with RealEngine.start(env, models[kind], log=log, args=args,
                                  extra_env=extra_env) as engine:
                outcome = run(engine)
            text = log.read_text(errors="replace").replace(str(models[kind]),
                                                           f"/tmp/realengine/{kind}-model")
            assert FAKE_ENGINE_KEY in text or "api_key" not in text
            if "cut_after" in outcome:  # cut once the engine is gone: it writes until then
                end = text.index(outcome["cut_after"])
                text = text[: text.index("\n", end) + 1]
            log.write_text(text)
            record[name] = outcome
            print(name, json.dumps(outcome))
    record_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
