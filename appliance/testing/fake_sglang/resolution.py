"""What SGLang 0.5.23's main process logs before its `server_args=` line, written by the
engine emulator (a test and demo instrument, `appliance.testing.fake_sglang`).

`Engine._launch_subprocesses` (srt/entrypoints/engine.py) runs `configure_logger`, then
`server_args.resolve_once()` (the model overrides and hooks, each of which may log), then
`_set_envs_and_config` (`set_ulimit`), and only then logs `server_args=`. So a real log's
launch begins with these records, and a reader that starts a run at `server_args=` sees them
as the end of the run before. The emulator writes the ones the K3 box's resolution logs, from
the same conditions as the source (srt/arg_groups/model_overrides/kimi_k3.py,
kimi_k3_hook.py, speculative_hook.py), on the box it plays (SM103: B300), and tries the same
`RLIMIT_NOFILE` raise as `set_ulimit`, logging its failure as SGLang does.

Import-time warnings (Python's `warnings` format, e.g. the CPU box's "Triton is not supported
on current platform") depend on the machine's packages: not emulated (docs/emulator.md).
"""

from __future__ import annotations

import resource

from appliance.testing.fake_sglang.args import SPEC_RESET_WARNING, ServeArgs

K3_CLASS = "KimiK3ForConditionalGeneration"
NOFILE_TARGET = 65535  # set_ulimit's target_soft_limit


def k3_resolution(args: ServeArgs, architecture: str, mxfp4: bool) -> list[str]:
    """The records `resolve_once` logs for this argv on a B300 box, in its order."""
    lines: list[str] = []
    values = args.values
    if architecture == K3_CLASS:
        if args.dcp_size > 1:
            if values.get("enable_symm_mem") is True:
                lines.append("Kimi-K3 DCP disables --enable-symm-mem due to decode CUDA graph "
                             "correctness issues.")
            prefill = values.get("prefill_attention_backend") or values.get("attention_backend")
            decode = values.get("decode_attention_backend") or values.get("attention_backend")
            if decode in (None, "cutedsl_mla"):
                lines.append(f"Kimi-K3 DCP keeps decode attention backend 'cutedsl_mla' "
                             f"(prefill={prefill!r} -> 'trtllm_mla').")
            if values.get("dcp_replicate_q_proj") is None \
                    and values.get("dcp_comm_backend") in ("a2a", "fi_a2a"):
                lines.append("Kimi-K3 DCP enables replicated Q projection by default.")
        elif not any(values.get(k) for k in ("attention_backend", "prefill_attention_backend",
                                              "decode_attention_backend")):
            if values.get("speculative_algorithm") == "DSPARK":
                lines.append("Kimi-K3 DSPARK on SM100/SM103: decode/verify attention backend "
                             "trtllm_mla (speculative_attention_mode=decode).")
            elif not args.speculative:
                lines.append("Use trtllm_mla as the default prefill and decode attention "
                             "backend for Kimi-K3 on SM100/SM103.")
        if mxfp4 and values.get("moe_runner_backend") in (None, "auto"):
            lines.append("Kimi-K3 on SM100/SM103/SM107: moe_runner_backend=flashinfer_mxfp4 "
                         "(FlashInfer SiTU kernels).")
    if args.speculative and values.get("max_running_requests") is None:
        lines.append(SPEC_RESET_WARNING)
    if architecture == K3_CLASS:
        if args.speculative and values.get("linear_attn_verify_backend") is None:
            lines.append("Kimi hybrid model with speculative decoding: pinning "
                         "--linear-attn-verify-backend to nv_cutedsl (uses the fused "
                         "Kimi-K3/DSPARK CuTeDSL kernel).")
        if values.get("speculative_algorithm") == "DSPARK" \
                and values.get("speculative_draft_attention_backend") is None:
            lines.append("Kimi hybrid DSPARK: defaulting --speculative-draft-attention-backend "
                         "to trtllm_mha.")
        if values.get("linear_attn_decode_backend") is None \
                and args.mamba_ssm_dtype == "bfloat16":
            lines.append("Kimi hybrid model with bf16 SSM state: defaulting "
                         "--linear-attn-decode-backend to triton.")
    return lines


def set_ulimit() -> list[str]:
    """srt/utils/common.py `set_ulimit`: raise the soft open-files limit to 65535; a refusal
    is one warning (the CPU box's `Fail to set RLIMIT_NOFILE: ...`), never a failure."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= NOFILE_TARGET:
        return []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_TARGET, hard))
    except ValueError as exc:
        return [f"Fail to set RLIMIT_NOFILE: {exc}"]
    return []


def prelaunch_lines(args: ServeArgs, architecture: str, mxfp4: bool) -> list[str]:
    """Everything the main process logs between its logger's setup and `server_args=`."""
    return [*k3_resolution(args, architecture, mxfp4), *set_ulimit()]
