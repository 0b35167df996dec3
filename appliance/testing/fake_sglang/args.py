"""The engine emulator's argv: SGLang 0.5.23's `sglang serve` flags, parsed like SGLang does.

Part of a test and demo instrument (`appliance.testing.fake_sglang`). The parser is argparse
with `prog="sglang serve"` built from `appliance.engine.flags`, so a bad argv fails exactly the
way SGLang's own parser fails: exit 2 with `usage: sglang serve ...` and
`sglang serve: error: unrecognized arguments: --no-such-flag` (or `invalid int value`,
`invalid choice`) on stderr. `sglang serve <model>` is `--model-path <model>` and
`--model-type X` is taken out first, as in SGLang's `cli/serve.py`; a missing model path is
SGLang's `Exception` (exit 1), raised before the parser runs. The table is 0.5.23's whole
parser, so every real flag is accepted; the emulator acts on the few that shape what it shows
(see `memory.py`) and reports the rest back in `/server_info`. `--config FILE.yaml` is
merged first, as SGLang's `ConfigArgumentMerger` does (utils/server_args_config_parser.py): the
file's keys become flags placed before the command line's, so the command line wins; that is
how the appliance hands the engine its `--api-key` without putting it on the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from appliance.engine.flags import FLAGS, Flag

DEFAULT_MAMBA_RATIO = 0.9  # schedule.py: resolvable, fallback=0.9
DEFAULT_MEM_FRACTION_STATIC = 0.93  # the emulator's "auto": the sample log's value
SPEC_DEFAULT_MAX_RUNNING = 48  # speculative_hook.py: "Max running requests is reset to 48"
SPEC_RESET_WARNING = (
    "Max running requests is reset to 48 for speculative decoding. You can override this by "
    "explicitly setting --max-running-requests."
)
MISSING_MODEL = "Error: --model-path is required. Please provide the path to the model."


class ArgvError(Exception):
    """An argv SGLang would refuse after argparse accepted it (exit 1 with a traceback)."""

    def __init__(self, exception_type: str, message: str) -> None:
        super().__init__(message)
        self.exception_type = exception_type
        self.message = message


def dest(flag: Flag) -> str:
    return flag.name.removeprefix("--").replace("-", "_")


def human_readable_int(value: str) -> int:
    """srt/utils/common.py:3394: an int with an SI (k, M, G, T) or IEC (Ki, Mi, Gi, Ti)
    suffix; the name is what argparse shows."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match:
        number, suffix = match.groups()
        if suffix in IEC:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with IEC suffixes like '{suffix}'. Use an integer "
                    f"IEC value such as '{int(Decimal(number))}{suffix}', or an SI value such as "
                    f"'{number}{suffix[0]}'.")
            return int(number) * IEC[suffix]
        return int(Decimal(number) * SI[suffix])
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. Use a plain integer, SI suffixes (1k, 1M), or IEC "
            f"suffixes (1Ki, 1Mi). Suffixes are case-sensitive.") from None


SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
CONVERTERS: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "size": human_readable_int, "json": json.loads,
}


def build_parser() -> argparse.ArgumentParser:
    """SGLang's parser, rebuilt from the flag table: same library, same prog, same messages."""
    parser = argparse.ArgumentParser(prog="sglang serve")
    for flag in FLAGS:
        names = [flag.name, *flag.aliases]
        if flag.kind == "bool":
            default = flag.default if flag.default is not None else (
                None if flag.negations else False)
            parser.add_argument(*names, dest=dest(flag), action="store_true", default=default)
            for negation in flag.negations:
                parser.add_argument(negation, dest=dest(flag), action="store_false")
            continue
        convert = CONVERTERS.get(flag.kind, str)
        choices = [convert(c) for c in flag.choices] or None
        parser.add_argument(*names, dest=dest(flag), default=flag.default, type=convert,
                            choices=choices, nargs=flag.nargs or None)
    return parser


def normalize(argv: Sequence[str]) -> list[str]:
    """What `sglang serve` hands its parser (cli/serve.py): `--model-type X` removed (it picks
    the backend), and a leading positional model path turned into `--model-path`."""
    rest: list[str] = []
    skip = False
    for index, item in enumerate(argv):
        if skip:
            skip = False
            continue
        if item == "--model-type":
            skip = index + 1 < len(argv)
            continue
        if item.startswith("--model-type="):
            continue
        rest.append(item)
    if rest and not rest[0].startswith("-"):
        return ["--model-path", rest[0], *rest[1:]]
    return rest


def has_model_path(argv: Sequence[str]) -> bool:
    """cli/utils.py try_get_model_path, which runs before the parser."""
    for index, item in enumerate(argv):
        if item in ("--model-path", "--model") and index + 1 < len(argv):
            return True
        if item.startswith(("--model-path=", "--model=")):
            return True
    return False


@dataclass(frozen=True)
class ServeArgs:
    """The parsed flags (argparse `dest` names) and the argv they came from."""

    values: Mapping[str, object]
    argv: tuple[str, ...]

    def _int(self, key: str) -> int | None:
        value = self.values.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _float(self, key: str) -> float | None:
        value = self.values.get(key)
        return float(value) if isinstance(value, int | float) else None

    def _str(self, key: str) -> str | None:
        value = self.values.get(key)
        return value if isinstance(value, str) else None

    def _bool(self, key: str) -> bool:
        return self.values.get(key) is True

    @property
    def model_path(self) -> str:
        return self._str("model_path") or ""

    @property
    def served_model_name(self) -> str:
        return self._str("served_model_name") or self.model_path

    @property
    def tp_size(self) -> int:
        return max(1, self._int("tp_size") or 1)

    @property
    def dcp_size(self) -> int:
        return max(1, self._int("dcp_size") or 1)

    @property
    def host(self) -> str:
        return self._str("host") or "127.0.0.1"

    @property
    def port(self) -> int:
        return self._int("port") or 30000

    @property
    def mem_fraction_static(self) -> float:
        value = self._float("mem_fraction_static")
        return DEFAULT_MEM_FRACTION_STATIC if value is None else value

    @property
    def mamba_full_memory_ratio(self) -> float:
        value = self._float("mamba_full_memory_ratio")
        return DEFAULT_MAMBA_RATIO if value is None else value

    @property
    def speculative(self) -> bool:
        return bool(self._str("speculative_algorithm"))

    @property
    def requested_max_running_requests(self) -> int | None:
        """What the scheduler starts from: the flag, or 48 under speculative decoding."""
        value = self._int("max_running_requests")
        if value is None and self.speculative:
            return SPEC_DEFAULT_MAX_RUNNING
        return value

    @property
    def max_mamba_cache_size(self) -> int | None:
        return self._int("max_mamba_cache_size")

    @property
    def kv_cache_dtype(self) -> str:
        return self._str("kv_cache_dtype") or "auto"

    @property
    def mamba_ssm_dtype(self) -> str:
        if self._bool("enable_linear_replayssm_spec"):
            return "float32"  # attention_hook.py forces float32 under ReplaySSM
        return self._str("mamba_ssm_dtype") or "float32"

    @property
    def replayssm(self) -> bool:
        return self._bool("enable_linear_replayssm_spec")

    @property
    def replayssm_cache_len(self) -> int:
        return self._int("linear_replayssm_cache_len") or 16

    @property
    def mamba_radix_cache_strategy(self) -> str:
        return self._str("mamba_radix_cache_strategy") or "auto"

    @property
    def chunked_prefill_size(self) -> int:
        return self._int("chunked_prefill_size") or 16384

    @property
    def max_prefill_tokens(self) -> int:
        return self._int("max_prefill_tokens") or 16384

    @property
    def max_total_tokens(self) -> int | None:
        return self._int("max_total_tokens")

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...] | None:
        value = self.values.get("cuda_graph_bs_decode")
        if isinstance(value, list | tuple) and value:
            return tuple(sorted({int(v) for v in value}))
        return None

    @property
    def disable_cuda_graph(self) -> bool:
        return self._bool("disable_cuda_graph")

    @property
    def context_length(self) -> int | None:
        return self._int("context_length")

    @property
    def page_size(self) -> int:
        return self._int("page_size") or 64  # forced to 64 for trtllm_mla / cutedsl_mla

    @property
    def enable_metrics(self) -> bool:
        return self._bool("enable_metrics")

    @property
    def api_key(self) -> str | None:
        return self._str("api_key")

    @property
    def enable_cache_report(self) -> bool:
        return self._bool("enable_cache_report")

    @property
    def reasoning_parser(self) -> str | None:
        return self._str("reasoning_parser")

    @property
    def tool_call_parser(self) -> str | None:
        return self._str("tool_call_parser")

    @property
    def decode_log_interval(self) -> int:
        return max(1, self._int("decode_log_interval") or 40)

    @property
    def skip_server_warmup(self) -> bool:
        return self._bool("skip_server_warmup")

    @property
    def disaggregation_mode(self) -> str:
        """null (serves alone), prefill or decode: a cell's engine (`disagg.py`)."""
        return self._str("disaggregation_mode") or "null"

    @property
    def disaggregation_bootstrap_port(self) -> int:
        return self._int("disaggregation_bootstrap_port") or 8998

    @property
    def launch_command(self) -> str:
        return "sglang serve " + shlex.join(self.argv)

    def resolved(self) -> dict[str, object]:
        """The flag values with the emulator's resolutions applied (server_info's top level
        and the `server_args=` log line). API keys are echoed IN CLEAR, as SGLang 0.5.23 does
        (`resolved_dict()` through `redact_watermark_secrets`, which redacts only watermark
        secrets): the appliance must keep them out of what it shows, not the engine."""
        values = dict(self.values)
        values["served_model_name"] = self.served_model_name
        values["tokenizer_path"] = self.model_path
        values["mem_fraction_static"] = self.mem_fraction_static
        values["mamba_full_memory_ratio"] = self.mamba_full_memory_ratio
        values["max_running_requests"] = self.requested_max_running_requests
        values["mamba_ssm_dtype"] = self.mamba_ssm_dtype
        values["mamba_radix_cache_strategy"] = self.mamba_radix_cache_strategy
        values["chunked_prefill_size"] = self.chunked_prefill_size
        values["page_size"] = self.page_size
        values.pop("config", None)  # merged into the other flags, not a ServerArgs field
        return values

    def server_args_line(self) -> str:
        """`server_args={...}`, as 0.5.23's engine.py logs it: the `repr` of
        `_server_args_for_logging(server_args)`, a dict of the resolved values, `api_key`
        included in clear."""
        return f"server_args={self.resolved()!r}"


def parse(argv: Sequence[str]) -> ServeArgs:
    """Parse like SGLang's `prepare_server_args`. argparse errors raise SystemExit(2) after
    printing SGLang's usage and message; semantic refusals raise `ArgvError`."""
    normalized = normalize(argv)
    if not has_model_path(normalized) and not {"-h", "--help"} & set(normalized):
        raise ArgvError("Exception", MISSING_MODEL)
    parser = build_parser()
    namespace = parser.parse_args(merge_config(parser, normalized))
    values = vars(namespace)
    level = values.get("log_level")
    if isinstance(level, str) and not isinstance(getattr(logging, level.upper(), None), int):
        raise ArgvError("AttributeError", f"module 'logging' has no attribute '{level.upper()}'")
    return ServeArgs(values=values, argv=tuple(argv))


def merge_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with its `--config FILE` replaced by the file's settings, put first (SGLang's
    `ConfigArgumentMerger.merge_config_with_args`: only the separate `--config FILE` form,
    one file, `.yaml`/`.yml`, a mapping; a switch is added when true; a list is its values;
    anything else its `str`). Its refusals are SGLang's ValueErrors."""
    if "--config" not in argv:
        return argv
    import yaml  # only when a config file is given, as SGLang imports it

    at = [i for i, item in enumerate(argv) if item == "--config"]
    if len(at) > 1:
        raise ArgvError("ValueError", "Multiple config files specified! Only one allowed.")
    index = at[0]
    if index == len(argv) - 1:
        raise ArgvError("ValueError", "No config file specified after --config flag!")
    path = Path(argv[index + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ArgvError("ValueError", f"Config file must be YAML format, got: {path.suffix}")
    if not path.exists():
        raise ArgvError("ValueError", f"Config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ArgvError("ValueError", "Config file must contain a dictionary at root level")
    switches = {action.dest for action in parser._actions
                if isinstance(action, argparse._StoreTrueAction)}
    merged: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            if str(key).replace("-", "_") not in switches:
                merged += [f"--{key}", str(value).lower()]
            elif value:
                merged.append(f"--{key}")
        elif isinstance(value, list):
            if value:
                merged += [f"--{key}", *(str(item) for item in value)]
        elif isinstance(value, dict):
            merged += [f"--{key}", json.dumps(value)]
        else:
            merged += [f"--{key}", str(value)]
    return merged + argv[:index] + argv[index + 2:]
