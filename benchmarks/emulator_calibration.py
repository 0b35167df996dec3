"""The engine emulator's performance model against the field figures it is calibrated from.

    .venv/bin/python benchmarks/emulator_calibration.py [--perf k3-b300[,knob=value...]]
        [--prompts 200] [--input-len 8192] [--output-len 1024] [--max-running 62]

Runs `appliance.testing.fake_sglang.calibration.simulate` (a closed-loop bench_serving-like
client over the emulator's own scheduler, in model time: no HTTP, no sleeping, a few seconds)
at client concurrency 10-50 and prints the modelled table beside the field table (one B300x8,
SGLang, Kimi K3, random 8K-in/1K-out, 200 prompts), with model/field ratios. `--perf` takes
the same text as `FAKE_SGLANG_PERF`, so a knob can be tried before it goes into a profile.

Targets (issue 15): ITL median and output tok/s within 15% (ratio 0.85-1.15) at 10-40; at 50,
failures and a TTFT p90 over 10 s.
"""

from __future__ import annotations

import argparse
import sys

from appliance.testing.fake_sglang.calibration import FIELD, FIELD_MAX_RUNNING, simulate
from appliance.testing.fake_sglang.perfmodel import PerfError, parse_perf


def ratio(model: float, field: float | None) -> str:
    return f"{model / field:5.2f}" if field else "    -"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--perf", default="k3-b300")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-running", type=int, default=FIELD_MAX_RUNNING)
    args = parser.parse_args(argv)
    try:
        model = parse_perf(args.perf)
    except PerfError as exc:
        print(f"emulator_calibration: {exc}", file=sys.stderr)
        return 2
    if model is None:
        print("emulator_calibration: --perf off has no model to compare", file=sys.stderr)
        return 2
    print(f"model {args.perf}: step {model.base_seconds * 1000:g} ms + "
          f"{model.per_request_seconds * 1000:g} ms x batch, {model.tokens_per_step:g} "
          f"tokens/step, prefill {model.prefill_tps:g} tok/s, chunk {model.chunk_tokens}, "
          f"pool {model.kv_tokens} tokens, waiting timeout {model.waiting_timeout:g} s")
    print(f"load: {args.prompts} prompts, {args.input_len} in / {args.output_len} out, "
          f"max running {args.max_running}\n")
    header = (f"{'users':>5} | {'out tok/s':>17} {'ratio':>5} | {'ITL ms':>13} {'ratio':>5} | "
              f"{'TTFT med s':>11} | {'TTFT p90 s':>11} {'ratio':>5} | {'failed':>9} | retracted")
    print(header)
    print("-" * len(header))
    for point in FIELD:
        got = simulate(point.concurrency, model, prompts=args.prompts,
                       input_len=args.input_len, output_len=args.output_len,
                       max_running=args.max_running)
        itl_field = f"{point.itl_median_ms:5.1f}" if point.itl_median_ms else "    -"
        med_field = f"{point.ttft_median_s:4.1f}" if point.ttft_median_s else "   -"
        print(f"{point.concurrency:>5} | {got.output_tps:7.1f} vs {point.output_tps:6.1f} "
              f"{ratio(got.output_tps, point.output_tps)} | {got.itl_median * 1000:5.1f} vs "
              f"{itl_field} {ratio(got.itl_median * 1000, point.itl_median_ms)} | "
              f"{got.ttft_median:4.1f} vs {med_field} | {got.ttft_p90:4.1f} vs "
              f"{point.ttft_p90_s:4.1f} {ratio(got.ttft_p90, point.ttft_p90_s)} | "
              f"{got.failed:>3} vs {point.failed:>3} | {got.retracted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
