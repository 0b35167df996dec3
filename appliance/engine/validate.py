"""Is this argv one SGLang 0.5.23 will accept? Asked before a 90-minute load, answered in seconds.

Two ways to answer, best first:

- `validate_with_sglang`: SGLang's own parser, `sglang.srt.server_args.prepare_server_args`, run
  by the engine environment's Python in a subprocess (the daemon never imports sglang). It is
  what `sglang serve` calls (cli/serve.py:104-109): argparse over every option, then building
  the ServerArgs record; no GPU, no model files, no resolution (server_args.py:668-720). Errors
  are argparse's (exit 2, "sglang serve: error: ...") or an exception such as the
  AttributeError of a bad --log-level. Importing sglang takes seconds, hence the timeout.
- `check_argv`: the flag table (`appliance.engine.flags`), pure, in milliseconds; used where
  the engine environment is missing or cannot import sglang.

`validate_launch_spec` picks between them and says which one answered. Both functions that run
a subprocess block: callers on the event loop run them in a thread.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from appliance.engine import flags
from appliance.engine.args import LaunchSpec, Origin, is_option, split_args
from appliance.engine.flags import Flag

TABLE_METHOD = f"flag table of sglang {flags.SGLANG_VERSION}"
HELP = ("-h", "--help")
_MARK = "APPLIANCE-VALIDATE "
# The child's environment: never the daemon's systemd socket, never the daemon's Python path.
_SCRUBBED_ENV = ("NOTIFY_SOCKET", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")

_WHERE = {
    Origin.OPERATOR: "fix it in engine.extra_args (config) or the console's engine flags",
    Origin.PROFILE: "it comes from the workload profile; choose or fix the profile",
    Origin.TUNING: "it comes from the applied tuning result; re-run or revert the tuning",
    Origin.ROLE: "it comes from the box's cell role; fix the [cell] section of the config",
    Origin.CLASSES: "it comes from the service classes; fix the [gateway.classes] tables",
    Origin.DEFAULT: "it is a built-in default: an appliance bug, please report it",
}


@dataclass(frozen=True)
class ArgProblem:
    """One thing wrong with an argv: the flag (or stray token) it is about, what is wrong, and
    what to do. `message` starts with the flag so a list of them reads well on its own."""

    flag: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


@dataclass(frozen=True)
class ValidationResult:
    """`method` says who answered: "sglang 0.5.23 parser" or "flag table of sglang 0.5.23";
    `note` says why the table answered, or anything else worth knowing about the check."""

    ok: bool
    method: str
    problems: tuple[ArgProblem, ...] = ()
    note: str = ""


# --------------------------------------------------------------------------- the flag table


def check_argv(argv: Sequence[str]) -> list[ArgProblem]:
    """Check the arguments after `serve` against SGLang 0.5.23's flag table.

    Reports what SGLang's parser would refuse (an unknown or ambiguous flag, a missing value,
    a value of the wrong type or outside the choices, a switch given a value, a stray value,
    no --model-path, --help) and, beyond it, a flag given twice (argparse silently keeps the
    last). Aliases and unambiguous abbreviations count as the flag they name, as in argparse.
    A leading value is the model path, as `sglang serve <model>` reads it (cli/serve.py:63).
    """
    items = split_args(argv)
    if items and items[0][0] == "":
        items[0] = ("--model-path", items[0][1])
    problems: list[ArgProblem] = []
    seen: dict[str, str] = {}
    given: dict[str, tuple[str, ...]] = {}
    previous: tuple[str, Flag | None] = ("", None)
    for option, values in items:
        flag, problem = _resolve(option, values, previous)
        previous = (option, flag)
        if problem is not None:
            problems.append(problem)
            continue
        assert flag is not None
        if flag.name in seen:
            first = seen[flag.name]
            also = f" (first as {first})" if first != option else ""
            problems.append(ArgProblem(
                option, f"{option}: given more than once{also}; SGLang keeps the last one",
                "keep one: which one wins should not depend on the order of the flags",
            ))
        else:
            seen[flag.name] = option
        given[flag.name] = values
        problems.extend(_check_values(option, flag, values))
    problems.extend(priority_problems(given, seen))
    if "--model-path" not in seen:
        problems.append(ArgProblem(
            "--model-path", "--model-path: required, and missing",
            "give the directory of the model's files (the appliance sets it from engine.model)",
        ))
    return problems


def priority_problems(given: dict[str, tuple[str, ...]],
                      spelled: dict[str, str]) -> list[ArgProblem]:
    """SGLang's rules for priority scheduling (srt/arg_groups/validation_hook.py:281-305),
    which it checks only once the engine starts: `--retraction-policy priority` needs
    `--enable-priority-scheduling` (ValueError), and priority scheduling needs the schedule
    policy fcfs or lof (AssertionError). Its warnings (a priority flag without priority
    scheduling has no effect) are not problems: the engine starts."""
    problems: list[ArgProblem] = []
    enabled = "--enable-priority-scheduling" in given
    if given.get("--retraction-policy") == ("priority",) and not enabled:
        problems.append(ArgProblem(
            spelled["--retraction-policy"],
            f"{spelled['--retraction-policy']} priority: requires --enable-priority-scheduling",
            "add --enable-priority-scheduling, or use --retraction-policy length"))
    policy = given.get("--schedule-policy", ("fcfs",))
    if enabled and policy and policy[0] not in ("fcfs", "lof"):
        problems.append(ArgProblem(
            spelled["--schedule-policy"],
            f"{spelled['--schedule-policy']} {policy[0]}: priority scheduling "
            "(--enable-priority-scheduling) works only with fcfs or lof",
            "use --schedule-policy fcfs (or lof), or remove --enable-priority-scheduling"))
    return problems


def _resolve(
    option: str, values: tuple[str, ...], previous: tuple[str, Flag | None]
) -> tuple[Flag | None, ArgProblem | None]:
    if option == "":
        token = values[0]
        spelled, before = previous
        if before is not None and not before.takes_value:
            return None, ArgProblem(
                spelled, f"{spelled}: a switch, takes no value (got {token!r})",
                "remove the value: the switch alone turns it on",
            )
        return None, ArgProblem(
            token, f"{token!r}: a value with no flag before it",
            "SGLang stops with 'unrecognized arguments'; put its flag before it or remove it",
        )
    if option in HELP:
        return None, ArgProblem(
            option, f"{option}: prints help and exits; the engine would not start",
            "remove it (run `sglang serve --help` by hand to read the options)",
        )
    found = flags.match(option)
    if not found:
        return None, unknown_flag(option)
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:6]) + (", ..." if len(found) > 6 else "")
        return None, ArgProblem(
            option, f"{option}: ambiguous abbreviation; could be {names}",
            "write the flag in full",
        )
    return found[0], None


def unknown_flag(option: str) -> ArgProblem:
    """The problem for an option SGLang 0.5.23 does not have, with the nearest real one."""
    close = difflib.get_close_matches(option, list(flags.BY_NAME), n=1, cutoff=0.6)
    if close:
        return ArgProblem(
            option, f"{option}: unknown flag; did you mean {close[0]}?",
            f"SGLang {flags.SGLANG_VERSION} would stop with 'unrecognized arguments'",
        )
    return ArgProblem(
        option, f"{option}: unknown flag (not an option of sglang serve {flags.SGLANG_VERSION})",
        "check it against `sglang serve --help` of the installed engine",
    )


_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "size": "an integer, optionally with a suffix k, M, G, T, Ki, Mi, Gi or Ti",
    "json": "JSON",
}


def _check_values(option: str, flag: Flag, values: tuple[str, ...]) -> list[ArgProblem]:
    if not flag.takes_value:
        if values:
            return [ArgProblem(
                option, f"{option}: a switch, takes no value (got {values[0]!r})",
                "remove the value: the switch alone turns it on",
            )]
        return []
    if not values and flag.nargs in ("", "+"):
        wanted = "a value" if flag.nargs == "" else "one or more values"
        expected = _EXPECTED.get(flag.kind, "")
        return [ArgProblem(
            option, f"{option}: missing value", f"give it {wanted}" + (
                f" ({expected})" if expected else ""
            ),
        )]
    problems = []
    for value in values:
        converted = _convert(flag.kind, value)
        if converted is _REFUSED:
            problems.append(ArgProblem(
                option, f"{option}: {value!r} is not {_EXPECTED[flag.kind]}",
                f"give {_EXPECTED[flag.kind]}",
            ))
        elif flag.choices and converted not in [_convert(flag.kind, c) for c in flag.choices]:
            close = difflib.get_close_matches(value, flag.choices, n=1)
            guess = f"; did you mean {close[0]}?" if close else ""
            problems.append(ArgProblem(
                option, f"{option}: {value!r} is not one of its choices{guess}",
                "choose from " + ", ".join(flag.choices),
            ))
        elif flag.name == "--log-level" and value.upper() not in _LOG_LEVELS:
            # Not an argparse choice: prepare_server_args does getattr(logging, value.upper())
            # (server_args.py:704) and stops with an AttributeError.
            problems.append(ArgProblem(
                option, f"{option}: {value!r} is not a log level",
                "choose from " + ", ".join(level.lower() for level in _LOG_LEVELS),
            ))
    return problems


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _convert(kind: str, value: str) -> object:
    """The value as SGLang's argparse type would read it; `_REFUSED` if it would refuse it."""
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "size":  # srt/utils/common.py:3394 human_readable_int
            match = _SIZE.fullmatch(value.strip())
            if match is None:
                return int(value)
            number, suffix = match.groups()
            if suffix in _IEC:
                return _REFUSED if "." in number else int(number) * _IEC[suffix]
            return int(Decimal(number) * _SI[suffix])
        if kind == "json":
            parsed: object = json.loads(value)
            return parsed
    except (ValueError, InvalidOperation):
        return _REFUSED
    return value


_REFUSED = object()


# --------------------------------------------------------------------------- SGLang's parser

# Runs in the engine environment's Python. Prints one marked JSON line on stdout; everything
# the import prints is ignored. argparse writes its error to stderr, captured here.
_SCRIPT = r"""
import contextlib, io, json, sys
def report(**kw):
    sys.__stdout__.write("APPLIANCE-VALIDATE " + json.dumps(kw) + "\n")
    sys.__stdout__.flush()
argv = json.loads(sys.argv[1])
try:
    from sglang.srt.server_args import prepare_server_args
except BaseException as exc:
    report(status="unavailable", detail="cannot import sglang.srt.server_args: %s: %s"
           % (type(exc).__name__, exc))
    raise SystemExit(0)
try:
    from sglang.version import __version__ as version
except BaseException:
    version = "unknown"
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err):
        prepare_server_args(argv)
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    report(status="exit", code=code, stderr=err.getvalue()[-8000:], version=version)
except ImportError as exc:
    report(status="unavailable", detail="%s: %s" % (type(exc).__name__, exc))
except BaseException as exc:
    report(status="error", error="%s: %s" % (type(exc).__name__, exc), version=version)
else:
    report(status="ok", version=version)
"""


@dataclass(frozen=True)
class _Unavailable:
    """SGLang's parser could not give an answer (as opposed to refusing the argv)."""

    reason: str
    hint: str


def validate_with_sglang(
    venv: Path, argv: Sequence[str], timeout: float = 60
) -> ValidationResult:
    """Ask SGLang's own parser, in `<venv>/bin/python`, about the arguments after `serve`.

    Not ok, with one problem saying so, when there is no answer (no Python there, sglang not
    importable, a timeout, a crash); `validate_launch_spec` falls back to the table instead.
    """
    outcome = _run_sglang_parser(venv, argv, timeout)
    if isinstance(outcome, _Unavailable):
        return ValidationResult(
            False, f"sglang {flags.SGLANG_VERSION} parser",
            (ArgProblem("", outcome.reason, outcome.hint),),
        )
    return outcome


def validate_launch_spec(
    spec: LaunchSpec, venv: Path | None, timeout: float = 60
) -> ValidationResult:
    """Validate a launch spec with SGLang's parser when `<venv>/bin/python` can import sglang,
    else with the flag table; each problem's hint says which layer set the flag."""
    argv = spec.serve_args()
    note = "no engine environment configured (engine.venv is empty)"
    result: ValidationResult | None = None
    if venv is not None:
        outcome = _run_sglang_parser(venv, argv, timeout)
        if isinstance(outcome, _Unavailable):
            note = f"{outcome.reason}; {outcome.hint}"
        else:
            result = outcome
    if result is None:
        problems = tuple(check_argv(argv))
        result = ValidationResult(not problems, TABLE_METHOD, problems, note)
    owned = tuple(reserved_problems(spec))
    return ValidationResult(
        result.ok and not owned, result.method,
        owned + tuple(_with_origin(p, spec) for p in result.problems), result.note,
    )


# Flags the appliance sets itself and an operator layer must not: the engine's API key (an
# operator's would lock the gateway and the daemon out of the engine) and the --config file
# that carries it (exec-spec accepts only the daemon's own).
RESERVED_FLAGS = {"--api-key": "the appliance gives the engine its own key (secrets/"
                               "engine-api.key); the gateway's keys are for users",
                  "--config": "the appliance passes the engine's key in its own --config "
                              "file; put flags in engine.extra_args instead"}


def reserved_problems(spec: LaunchSpec) -> list[ArgProblem]:
    """Flags of `RESERVED_FLAGS` set by a layer other than the appliance's defaults."""
    out = []
    for arg in spec.args:
        found = flags.match(arg.flag)
        name = found[0].name if len(found) == 1 else arg.flag
        if name in RESERVED_FLAGS and arg.origin is not Origin.DEFAULT:
            out.append(ArgProblem(arg.flag, f"{arg.flag}: set by the appliance, not by the "
                                            f"{arg.origin.value} layer",
                                  f"{RESERVED_FLAGS[name]}; {_WHERE[arg.origin]}"))
    return out


def _with_origin(problem: ArgProblem, spec: LaunchSpec) -> ArgProblem:
    source = spec.source(problem.flag) if problem.flag else None
    if source is None:
        return problem
    where = f"set by the {source.origin.value} layer: {_WHERE[source.origin]}"
    return ArgProblem(problem.flag, problem.message, f"{problem.hint}; {where}".lstrip("; "))


def sglang_argv(argv: Sequence[str]) -> tuple[list[str], list[ArgProblem]]:
    """What `sglang serve` hands `prepare_server_args` (cli/serve.py:31-67, 181-187): the
    --model-type selector removed, a leading model path turned into --model-path."""
    out: list[str] = []
    problems: list[ArgProblem] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        backend = None
        if arg == "--model-type":
            backend = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2
        elif arg.startswith("--model-type="):
            backend = arg.partition("=")[2]
            i += 1
        else:
            out.append(arg)
            i += 1
            continue
        if backend not in ("auto", "llm"):
            problems.append(ArgProblem(
                "--model-type", f"--model-type: {backend!r} is not a language-model backend",
                "the appliance serves a language model: use auto or llm, or leave it out",
            ))
    if out and not out[0].startswith("-"):
        out = ["--model-path", *out]
    return out, problems


def _run_sglang_parser(
    venv: Path, argv: Sequence[str], timeout: float
) -> ValidationResult | _Unavailable:
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        return _Unavailable(
            f"no Python at {python}",
            "install the engine environment (the installer does) or set engine.venv",
        )
    parser_argv, problems = sglang_argv(argv)
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    try:
        proc = subprocess.Popen(
            [str(python), "-c", _SCRIPT, json.dumps(parser_argv)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, cwd=venv, start_new_session=True, text=True, errors="replace",
        )
    except OSError as exc:
        return _Unavailable(f"cannot run {python} ({exc.strerror or exc})",
                            "repair the engine environment (re-run the installer)")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # its own session: only the check dies
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return _Unavailable(
            f"SGLang's parser did not answer within {timeout:g} s",
            "importing sglang takes seconds; a longer stall points at a broken engine "
            "environment or a very slow disk",
        )
    report = _report(out)
    if report is None:
        tail = " ".join(err.strip().splitlines()[-3:])[-400:]
        return _Unavailable(
            f"the validation run exited {proc.returncode} without an answer"
            + (f" ({tail})" if tail else ""),
            "run the engine environment's python by hand to see why",
        )
    status = report.get("status")
    if status == "unavailable":
        return _Unavailable(str(report.get("detail", "sglang cannot be imported")),
                            "repair the engine environment (re-run the installer)")
    version = str(report.get("version", "unknown"))
    method = f"sglang {version} parser"
    note = "" if version == flags.SGLANG_VERSION else (
        f"the engine environment has sglang {version}; the appliance is built for "
        f"{flags.SGLANG_VERSION}"
    )
    if status == "exit":
        problems.extend(_argparse_problems(str(report.get("stderr", "")),
                                           int(report.get("code", 1)), version))
    elif status == "error":
        error = str(report.get("error", ""))
        flag = "--log-level" if "module 'logging' has no attribute" in error else _flag_in(error)
        problems.append(ArgProblem(
            flag, f"{flag}: {error}" if flag else error,
            f"SGLang {version} refused the arguments after parsing them",
        ))
    return ValidationResult(not problems, method, tuple(problems), note)


def _report(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(_MARK):
            try:
                report = json.loads(line[len(_MARK):])
            except json.JSONDecodeError:
                return None
            return report if isinstance(report, dict) else None
    return None


def _argparse_problems(stderr: str, code: int, version: str) -> list[ArgProblem]:
    if code == 0:
        return [ArgProblem("--help", "--help: prints help and exits; the engine would not start",
                           "remove it")]
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    if not errors:
        tail = " ".join(stderr.strip().splitlines()[-2:]) or f"exit status {code}"
        return [ArgProblem("", f"SGLang's parser stopped: {tail}", "")]
    text = errors[-1].split(": error: ", 1)[1]
    hint = f"SGLang {version}'s parser refused it"
    unrecognized = "unrecognized arguments: "
    if text.startswith(unrecognized):
        problems = []
        for token in text[len(unrecognized):].split():
            if is_option(token):
                option = token.partition("=")[0]
                guess = unknown_flag(option)
                problems.append(ArgProblem(option, guess.message, hint))
            else:
                problems.append(ArgProblem(
                    token, f"{token!r}: a value with no flag before it (unrecognized)", hint,
                ))
        return problems
    flag = _flag_in(text)
    if text.startswith("argument ") and ": " in text:
        text = text.split(": ", 1)[1]  # "argument --tp-size/--tensor-parallel-size: ..."
    return [ArgProblem(flag, f"{flag}: {text}" if flag else text, hint)]


_ARGUMENT = re.compile(r"(?:argument |option: |required: )(--?[\w-]+)")


def _flag_in(text: str) -> str:
    """The first option an argparse or SGLang message names ("argument --tp-size/...: ...")."""
    match = _ARGUMENT.search(text) or re.search(r"(--[\w-]+)", text)
    return match.group(1) if match else ""
