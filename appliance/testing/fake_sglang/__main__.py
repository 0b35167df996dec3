"""`python -m appliance.testing.fake_sglang serve <sglang serve argv>`: the SGLang 0.5.23
ENGINE EMULATOR, a test and demo instrument (see the package docstring).

Environment:
    FAKE_SGLANG_LOAD_SECONDS   the whole start, scaled from ~86 minutes (default 20)
    FAKE_SGLANG_FAULT          faults on demand (`faults.py`), e.g. `crash_at=60,slow_tokens=0.2`
    FAKE_SGLANG_PERF           the serving performance model (`perfmodel.py`), e.g. `k3-b300`
    FAKE_SGLANG_TIME_SCALE     real seconds per modelled second, e.g. 0.05 (with FAKE_SGLANG_PERF)
    FAKE_SGLANG_GPU_STATE      a JSON file to write the pretend GPUs' memory to (`gpustate.py`)
    SGLANG_HEALTH_CHECK_TIMEOUT, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, SGL_FORCE_SHUTDOWN,
    SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, SGLANG_DISAGGREGATION_WAITING_TIMEOUT
                               honoured as SGLang does (the last two: `disagg.py`)
Exit codes: 0 after a SIGTERM drain; 2 for a bad argv (argparse) or a bad FAKE_SGLANG_* value;
1 for a dead rank during startup or a refused argv; -9 (SIGKILL) after a child crash; -15 when
SIGTERM arrives before the server is ready (Python's default action, as in SGLang), or
after it but before any request reached its tokenizer manager (uvicorn's handler, then the
signal's default action: `lifecycle.py`).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from appliance.testing.fake_sglang.args import ArgvError, parse
from appliance.testing.fake_sglang.faults import FaultError, faults_from_env
from appliance.testing.fake_sglang.gpustate import GpuStateFile
from appliance.testing.fake_sglang.logwriter import LogWriter
from appliance.testing.fake_sglang.memory import Capacity, CapacityError, plan
from appliance.testing.fake_sglang.ranks import Children, RankDied
from appliance.testing.fake_sglang.resolution import prelaunch_lines
from appliance.testing.fake_sglang.startup import Startup, inspect_model
from appliance.testing.fake_sglang.tracebacks import SITE, scheduler_died

USAGE = "usage: python -m appliance.testing.fake_sglang serve [sglang serve flags]"
DEFAULT_LOAD_SECONDS = 20.0


def _load_seconds() -> float:
    raw = os.environ.get("FAKE_SGLANG_LOAD_SECONDS", "")
    if not raw:
        return DEFAULT_LOAD_SECONDS
    value = float(raw)
    if value < 0:
        raise ValueError(raw)
    return value


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        print("fake_sglang: the SGLang 0.5.23 engine emulator (a test and demo instrument) "
              "only emulates `sglang serve`", file=sys.stderr)
        return 2
    try:
        args = parse(argv[1:])
    except SystemExit as exc:  # argparse: usage + error already on stderr (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    except ArgvError as exc:
        print(f'Traceback (most recent call last):\n  File "{SITE}/cli/serve.py", line 222, '
              f"in serve\n{exc.exception_type}: {exc.message}", file=sys.stderr)
        return 1
    try:
        faults = faults_from_env(os.environ)
        load_seconds = _load_seconds()
    except FaultError as exc:
        print(f"fake_sglang: {exc}", file=sys.stderr)
        return 2
    except ValueError:
        print("fake_sglang: FAKE_SGLANG_LOAD_SECONDS must be a number of seconds, e.g. 20",
              file=sys.stderr)
        return 2
    gpu_path = Path(os.environ["FAKE_SGLANG_GPU_STATE"]) \
        if os.environ.get("FAKE_SGLANG_GPU_STATE") else None
    log = LogWriter(tp_size=args.tp_size)
    log.line(f"fake_sglang: SGLang 0.5.23 ENGINE EMULATOR (appliance.testing.fake_sglang), a "
             f"test and demo instrument: no GPU, no model, synthetic text. A full start takes "
             f"{load_seconds:g} s here (about 86 min on the real box).")
    model = inspect_model(args.model_path)
    for line in prelaunch_lines(args, model.architecture, model.mxfp4):
        log.line(line)
    log.line(args.server_args_line())
    capacity: Capacity | CapacityError
    try:
        capacity = plan(args, model.context_len)
    except CapacityError as exc:
        capacity = exc  # raised by rank 0 at allocation, as SGLang's scheduler does
    gpu = GpuStateFile(gpu_path)
    children = Children.spawn(args.tp_size, gpu_path)
    startup = Startup(args, capacity, faults, model, log, children, gpu, load_seconds)
    try:
        cap, timings = startup.run()
    except RankDied as died:
        log.raw(scheduler_died(died.rank, died.exit_code))
        children.kill_all()
        gpu.clear(args.tp_size)
        return 1
    # Imported only now, after the fork: the ranks never load uvicorn, and the first log line
    # comes sooner.
    from appliance.testing.fake_sglang.lifecycle import Lifecycle

    lifecycle = Lifecycle(args, cap, model, timings, faults, log, children, gpu, load_seconds)
    return asyncio.run(lifecycle.run())


if __name__ == "__main__":
    sys.exit(main())
