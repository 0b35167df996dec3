"""`appliance tune …`: what SGLang 0.5.23 would allocate, without a GPU, a daemon or a database.

`appliance tune predict` sizes the recurrent-state and KV pools for a model config, a launch
(every sizing flag) and a budget: given in GiB (`--budget-gib`) or measured from a startup log
(`--from-log`). Flags left out take the logged run's own `server_args` (with `--from-log`),
then the configuration's `[engine]` values (tp, dcp, KV dtype, mem-fraction-static, ratio,
speculative): `tune predict --from-log LOG` reproduces the logged run, and
`appliance --dev tune predict --budget-gib 52` answers for the configured launch.

Subcommands register in `COMMANDS` (name -> (add_arguments, handler)); the shared sizing flags
and their resolution (`add_sizing_arguments`, `launch_from_args`, `budget_from_args`) are here
for every subcommand that needs them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.config import CELL_ROLES, Config
from appliance.errors import EX_DATAERR, EX_USAGE, ApplianceError
from appliance.tuning.budget import Budget, budget_from_log, settings_from_log
from appliance.tuning.calculator import (
    GIB,
    KV_DTYPES,
    MAMBA_STRATEGIES,
    SPECULATIVE,
    STATE_DTYPES,
    Launch,
    Sizing,
    draft_pricing,
    resolve_ssm_dtype,
    size_pools,
)
from appliance.tuning.geometry import Geometry, load_draft, load_geometry

AddArguments = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace, Config], int]
DEFAULT_DRAFT_TOKENS = 8  # DSPARK's default gamma 7 (dspark_config.py:21) + 1
# Kimi K3's DSPARK draft (its config.json's num_hidden_layers): the layer count the draft's KV
# is priced by when its config is not at hand (`calculator.layer_scaled_cell`).
DEFAULT_DRAFT_LAYERS = 8


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    tune = sub.add_parser("tune", parents=[common],
                          help="predict SGLang's state/KV memory split (no GPU needed)")
    cmds = tune.add_subparsers(dest="tune_command", required=True)
    for name, (helptext, add_arguments, _) in COMMANDS.items():
        add_arguments(cmds.add_parser(name, parents=[common], help=helptext))


def run(args: argparse.Namespace, config: Config) -> int:
    _, _, handler = COMMANDS[args.tune_command]
    return handler(args, config)


# --- shared sizing flags ----------------------------------------------------------------------


def add_sizing_arguments(cmd: argparse.ArgumentParser) -> None:
    """The model, launch and budget flags; None means "the configuration's value"."""
    cmd.add_argument("--model-config", type=Path,
                     help="the model's config.json or directory (default: engine.model under "
                          "paths.models_dir)")
    cmd.add_argument("--tp", type=int, help="tensor-parallel size (default engine.tp_size)")
    cmd.add_argument("--dcp", type=int, help="decode-context-parallel size (default "
                                             "engine.dcp_size)")
    budget = cmd.add_mutually_exclusive_group()
    budget.add_argument("--budget-gib", type=float,
                        help="GiB per GPU left for the pools: free after weights minus the "
                             "mem-fraction-static slack")
    budget.add_argument("--from-log", type=Path,
                        help="measure the budget from an SGLang startup log")
    cmd.add_argument("--kv-dtype", choices=tuple(KV_DTYPES),
                     help="--kv-cache-dtype (default engine.kv_cache_dtype)")
    cmd.add_argument("--ssm-dtype", choices=tuple(STATE_DTYPES),
                     help="--mamba-ssm-dtype (default as SGLang resolves it: float32 for KDA)")
    cmd.add_argument("--spec", choices=SPECULATIVE,
                     help="speculative decoding (default: dspark when engine.speculative)")
    cmd.add_argument("--draft-config", type=Path,
                     help="the DSPARK draft's config.json (default <model>/dspark/config.json)")
    cmd.add_argument("--draft-layers", type=int,
                     help="without the draft's config: its layer count, to price its KV as "
                          f"SGLang does then (default {DEFAULT_DRAFT_LAYERS}, K3's DSPARK draft)")
    cmd.add_argument("--draft-tokens", type=int,
                     help="--speculative-num-draft-tokens (default: the draft's gamma + 1, "
                          "else 8)")
    cmd.add_argument("--draft-kv-dtype", choices=tuple(KV_DTYPES),
                     help="--speculative-draft-kv-cache-dtype (default: the KV dtype)")
    cmd.add_argument("--replayssm", action=argparse.BooleanOptionalAction,
                     help="--enable-linear-replayssm-spec (default off)")
    cmd.add_argument("--replayssm-cache-len", type=int,
                     help="--linear-replayssm-cache-len (default 16)")
    cmd.add_argument("--max-running-requests", type=int)
    cmd.add_argument("--max-mamba-cache-size", type=int)
    cmd.add_argument("--page-size", type=int,
                     help="KV page (default 64: what trtllm_mla / cutedsl_mla force)")
    cmd.add_argument("--mem-fraction-static", type=float,
                     help="with --from-log: re-derive the budget for this value instead of "
                          "the logged run's")
    cmd.add_argument("--mamba-strategy", choices=MAMBA_STRATEGIES,
                     help="--mamba-radix-cache-strategy as resolved (default: extra_buffer, "
                          "what auto resolves to for these models)")
    cmd.add_argument("--disable-radix-cache", action="store_true")
    cmd.add_argument("--context-length", type=int)
    cmd.add_argument("--language-model-only", action="store_true",
                     help="no multimodal reservation (SGLang's --language-model-only)")


def geometry_from_args(args: argparse.Namespace, config: Config) -> tuple[Geometry, Path]:
    path = args.model_config
    if path is None:
        path = config.paths.models_dir / config.engine.model.replace("/", "--") / "config.json"
    return load_geometry(path), path


def launch_from_args(args: argparse.Namespace, config: Config, geometry: Geometry,
                     model_path: Path, logged: dict[str, Any] | None = None) -> Launch:
    """The launch the flags describe; what they leave out comes from `logged` (the startup
    log's server_args, `settings_from_log`), then from the configuration's [engine]."""
    engine, logged = config.engine, logged or {}

    def pick(flag: Any, field: str, fallback: Any) -> Any:
        return flag if flag is not None else logged.get(field, fallback)

    spec = pick(args.spec, "speculative", "dspark" if engine.speculative else "none")
    draft = None
    if spec != "none":
        model_dir = model_path if model_path.is_dir() else model_path.parent
        draft_path = args.draft_config or model_dir / "dspark" / "config.json"
        if args.draft_config is not None or draft_path.exists():
            draft = load_draft(draft_path)
    gamma_tokens = draft.block_size + 1 if draft is not None and draft.block_size else None
    replayssm = pick(args.replayssm, "replayssm", False)
    return Launch(
        tp=pick(args.tp, "tp", engine.tp_size), dcp=pick(args.dcp, "dcp", engine.dcp_size),
        kv_dtype=pick(args.kv_dtype, "kv_dtype", engine.kv_cache_dtype),
        ssm_dtype=resolve_ssm_dtype(geometry, pick(args.ssm_dtype, "ssm_dtype", None),
                                    replayssm=replayssm),
        speculative=spec, draft=draft,
        # No draft config: SGLang's own fallback prices the draft's KV by its layer count.
        draft_layers=(DEFAULT_DRAFT_LAYERS if args.draft_layers is None else args.draft_layers)
        if spec != "none" and draft is None else None,
        draft_tokens=pick(args.draft_tokens, "draft_tokens",
                          gamma_tokens or DEFAULT_DRAFT_TOKENS),
        replayssm=replayssm,
        replayssm_cache_len=pick(args.replayssm_cache_len, "replayssm_cache_len", 16),
        page_size=pick(args.page_size, "page_size", 64),
        mem_fraction_static=pick(args.mem_fraction_static, "mem_fraction_static",
                                 engine.mem_fraction_static),
        max_running_requests=pick(args.max_running_requests, "max_running_requests", None),
        max_mamba_cache_size=pick(args.max_mamba_cache_size, "max_mamba_cache_size", None),
        radix_cache=pick(False if args.disable_radix_cache else None, "radix_cache", True),
        draft_kv_dtype=pick(args.draft_kv_dtype, "draft_kv_dtype", None),
        mamba_strategy=pick(args.mamba_strategy, "mamba_strategy", "extra_buffer"),
        context_length=pick(args.context_length, "context_length", None),
        language_model_only=args.language_model_only)


def read_log(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ApplianceError("tune_bad_input", f"{path}: cannot be read ({exc.strerror})",
                             "give the path of an SGLang startup log",
                             exit_code=EX_USAGE) from None


@dataclass(frozen=True)
class LogInput:
    """The startup log a command reads: `--from-log`, or this box's own engine log."""

    text: str
    source: str  # how the output names it
    own: bool  # this box's engine log (its last start), not a file given on the command line


def log_input(args: argparse.Namespace, config: Config) -> LogInput | None:
    """`--from-log` when given; else, when no `--budget-gib` either, the engine log of this
    box's last start (where the configured runner puts it); None when there is none."""
    if args.from_log is not None:
        return LogInput(read_log(args.from_log), str(args.from_log), own=False)
    if args.budget_gib is not None:
        return None
    from appliance.runtime import engine_runner

    path = engine_runner(config).engine_log(config.paths.log_dir)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return LogInput(text, f"the engine's last start on this box ({path})", own=True)


def budget_from_args(args: argparse.Namespace, log_text: str | None = None,
                     source: str | None = None) -> Budget:
    """--budget-gib as given, else the budget measured from a startup log: `log_text` (read
    by the caller: --from-log, or this box's own last start, named by `source`)."""
    if args.budget_gib is not None:
        if not args.budget_gib > 0:
            raise ApplianceError("tune_bad_input", f"--budget-gib {args.budget_gib} is not a "
                                 "positive number", "give the GiB per GPU left for the pools",
                                 exit_code=EX_USAGE)
        return Budget(int(args.budget_gib * GIB), False,
                      f"given: --budget-gib {args.budget_gib:g}")
    if log_text is None and args.from_log is None:
        raise ApplianceError(
            "tune_bad_input", "no budget: the engine has not started on this box yet, so "
            "there is no startup to measure", "give --budget-gib (the GiB per GPU left for "
            "the pools) or --from-log (an SGLang startup log)", exit_code=EX_USAGE)
    text = log_text if log_text is not None else read_log(args.from_log)
    where = source or str(args.from_log)
    budget = budget_from_log(text, source=where, mem_fraction_static=args.mem_fraction_static)
    if budget is None:
        raise ApplianceError(
            "tune_bad_input", f"{where}: no 'Load weight begin/end ... avail mem' "
            "lines, or no mem_fraction_static in its server_args line",
            "use the log of a startup that got past loading weights, or pass "
            "--mem-fraction-static / --budget-gib", exit_code=EX_DATAERR)
    return budget


# --- predict ----------------------------------------------------------------------------------


def _add_predict(cmd: argparse.ArgumentParser) -> None:
    add_sizing_arguments(cmd)
    cmd.add_argument("--ratio", type=float,
                     help="--mamba-full-memory-ratio (default engine.mamba_full_memory_ratio)")
    cmd.add_argument("--json", action="store_true", help="print JSON")


def predict(args: argparse.Namespace, config: Config) -> int:
    log = log_input(args, config)
    logged = settings_from_log(log.text) if log is not None else {}
    geometry, path = geometry_from_args(args, config)
    launch = launch_from_args(args, config, geometry, path, logged)
    budget = budget_from_args(args, log.text if log else None, log.source if log else None)
    ratio = args.ratio if args.ratio is not None else logged.get(
        "ratio", config.engine.mamba_full_memory_ratio)
    sizing = size_pools(geometry, launch, budget.bytes, ratio)
    if args.json:
        print(json.dumps({"model_config": str(path), "geometry": geometry.to_dict(),
                          "launch": asdict(launch), "budget": budget.to_dict(),
                          "sizing": sizing.to_dict(),
                          "draft_pricing": draft_pricing(launch)}, indent=2))
    else:
        print(render(geometry, launch, budget, sizing))
    return 0


def render(geometry: Geometry, launch: Launch, budget: Budget, sizing: Sizing) -> str:
    """The human table of one prediction."""
    kind = {"kda": "KDA", "gdn": "GDN"}.get(geometry.linear_kind, geometry.linear_kind)
    attention = geometry.attention.upper()
    spec = "" if launch.speculative == "none" else f", {launch.speculative.upper()}" + (
        " + ReplaySSM" if launch.replayssm else "")
    rows = [
        ("state slots (max_mamba_cache_size)", f"{sizing.max_mamba_cache_size:,}"),
        ("slots per running request", f"{sizing.mamba_slots_per_request}"),
        ("max_running_requests", f"{sizing.max_running_requests:,}  (limited by "
                                 f"{sizing.running_limited_by})"),
        ("KV rows per GPU (max_total_num_tokens)", f"{sizing.mla_rows_per_rank:,}"),
        (f"logical KV tokens (rows x DCP {launch.dcp})", f"{sizing.logical_tokens:,}"),
    ]
    data = sizing.to_dict()
    pools = [("conv state", "conv_state_gib"), ("ssm state", "ssm_state_gib"),
             ("ReplaySSM ring", "replayssm_gib"), ("speculative snapshots", "spec_state_gib"),
             (f"{attention} KV", "kv_gib"), ("draft KV", "draft_kv_gib"),
             ("multimodal reserve", "mm_reserved_gib")]
    width = max(len(label) for label, _ in rows)
    lines = [
        f"{geometry.model_type}: {geometry.linear_layers} {kind} + {geometry.full_layers} "
        f"{attention} layers; TP{launch.tp} DCP{launch.dcp}, KV {launch.kv_dtype}, SSM "
        f"{launch.ssm_dtype}{spec}; --mamba-full-memory-ratio {sizing.ratio:g}",
        f"budget: {budget.gib:.2f} GiB per GPU ({budget.detail})",
        *([f"{pricing}"] if (pricing := draft_pricing(launch)) else []), "",
        *(f"  {label:<{width}}  {value}" for label, value in rows), "",
        f"  {'pool':<{width}}  GiB per GPU",
        *(f"  {label:<{width}}  {data[key]:.2f}" for label, key in pools
          if data[key] or key in ("conv_state_gib", "ssm_state_gib", "kv_gib")),
        f"  {'total':<{width}}  {data['total_gib']:.2f} of {data['budget_gib']:.2f}",
    ]
    return "\n".join(lines)


# --- recommend and profiles -------------------------------------------------------------------


def _add_recommend(cmd: argparse.ArgumentParser) -> None:
    add_sizing_arguments(cmd)
    cmd.add_argument("--profile", required=True,
                     help="a built-in or custom profile (see `appliance tune profiles`)")
    cmd.add_argument("--current-ratio", type=float,
                     help="the ratio to compare with (default: the one the engine's last start "
                          "on this box used, else engine.mamba_full_memory_ratio)")
    cmd.add_argument("--role", choices=CELL_ROLES,
                     help="size for this cell role (default: this box's role)")
    cmd.add_argument("--chunked-prefill-size", type=int,
                     help="a prefill's batch in prompt tokens (default: SGLang's on a B300, "
                          "16384)")
    cmd.add_argument("--json", action="store_true", help="print JSON")


def recommend_command(args: argparse.Namespace, config: Config) -> int:
    """The ratio (or pin) that serves a profile best, against the configured one."""
    from appliance.cell.role_choice import effective_role
    from appliance.tuning.recommend import recommend
    from appliance.tuning.roles import role_target

    profile = _find_profile(config, args.profile)
    log = log_input(args, config)
    logged = settings_from_log(log.text) if log is not None else {}
    geometry, path = _recommend_geometry(args, config)
    launch = launch_from_args(args, config, geometry, path, logged)  # as `predict` does
    budget = budget_from_args(args, log.text if log else None, log.source if log else None)
    # "Current" is the ratio the engine runs with: what this box's last start logged; the
    # configured one only when the engine has not started here (or a foreign log was given).
    running = logged.get("ratio") if log is not None and log.own else None
    current = (args.current_ratio if args.current_ratio is not None
               else running if running is not None
               else config.engine.mamba_full_memory_ratio)
    current_from = ("given" if args.current_ratio is not None
                    # the log's last start: the engine may have stopped since, so
                    # never "the running engine's"
                    else "the engine's last start here" if running is not None
                    else "the configured")
    role = role_target(args.role or effective_role(config), profile.lengths,
                       profile.target_concurrency, chunked_prefill=args.chunked_prefill_size)
    rec = recommend(geometry, launch, budget.bytes, profile.lengths,
                    target_concurrency=profile.target_concurrency, current_ratio=current,
                    role=role)
    if args.json:
        print(json.dumps({"model_config": str(path), "profile": profile.to_dict(),
                          "launch": asdict(launch), "budget": budget.to_dict(),
                          "recommendation": rec.to_dict()}, indent=2))
        return 0
    from appliance.tuning.profiles import format_tokens

    def limits(cap: Any) -> str:
        pool = "KV" if cap.binding == "kv" else "state"
        return (f"{cap.concurrent} concurrent  (state limit {cap.state_limit}, KV limit "
                f"{cap.kv_limit}; {pool} binds; KV {format_tokens(cap.logical_tokens)} tokens)")

    target = (f"{rec.target_range[0]:g} to {rec.target_range[1]:g}" if rec.target_range
              else "none")
    rows = [
        ("recommended ratio", f"{rec.ratio:g}", limits(rec.recommended)),
        ("current ratio", f"{rec.current_ratio:g}", f"({current_from}) " + limits(rec.current)),
        ("gain", f"{rec.gain:+d}", "concurrent requests over the current ratio"),
        ("balanced ratio", "-" if rec.balanced_ratio is None else f"{rec.balanced_ratio:g}",
         "where the state limit meets the KV limit"),
        (f"meets target {rec.target_concurrency}", target, "ratios on the grid"),
    ]
    if rec.pin is not None:
        rows.append(("--max-mamba-cache-size", f"{rec.pin}", rec.pin_note))
    lines = [
        f"profile {profile.name} ({profile.title}): {profile.lengths.describe()}, mean "
        f"{format_tokens(profile.lengths.mean())}; target {profile.target_concurrency} "
        "concurrent",
        f"{geometry.model_type}: TP{launch.tp} DCP{launch.dcp}, KV {launch.kv_dtype}, SSM "
        f"{launch.ssm_dtype}; budget {budget.gib:.2f} GiB per GPU "
        f"({'measured' if budget.measured else 'given or estimated'}: {budget.detail})", "",
        *(f"  {label:<24} {value:<8} {note}" for label, value, note in rows), "",
        f"gives up: {rec.gives_up}",
    ]
    if rec.cap_note:
        lines.append(f"cap: {rec.cap_note}")
    if role.role != "unified":
        lines.append(f"role: {role.role}: {role.basis}")
    if role.max_running_requests is not None:
        lines.append(f"start it with --max-running-requests {role.max_running_requests}")
    lines += ["", rec.summary]
    print("\n".join(lines))
    return 0


def _add_profiles(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("name", nargs="?", help="show this profile (default: list them all)")
    cmd.add_argument("--json", action="store_true", help="print JSON")


def profiles_command(args: argparse.Namespace, config: Config) -> int:
    """List the built-in and custom profiles, or show one."""
    from appliance.tuning.profiles import BUILTIN, format_tokens

    if args.name:
        profile = _find_profile(config, args.name)
        if args.json:
            print(json.dumps(profile.to_dict(), indent=2))
            return 0
        kind = "built-in" if profile.builtin else "custom"
        lengths = profile.lengths
        print("\n".join([
            f"{profile.name} ({kind}): {profile.title}", f"  {profile.description}",
            f"  target {profile.target_concurrency} concurrent requests",
            f"  tokens per live request: minimum {format_tokens(lengths.minimum)}, "
            f"{lengths.describe()}; mean {format_tokens(lengths.mean())}"]))
        return 0
    custom, note = _custom_profiles(config)
    profiles = [*BUILTIN, *custom]
    if args.json:
        print(json.dumps({"profiles": [p.to_dict() for p in profiles], "custom_note": note},
                         indent=2))
        return 0
    print(f"{'name':<20} {'kind':<8} {'target':>6}  {'p50':>6} {'mean':>6} {'max':>6}  title")
    for p in profiles:
        print(f"{p.name:<20} {'built-in' if p.builtin else 'custom':<8} "
              f"{p.target_concurrency:>6}  {format_tokens(p.lengths.quantile(50)):>6} "
              f"{format_tokens(p.lengths.mean()):>6} {format_tokens(p.lengths.max):>6}  "
              f"{p.title}")
    if note:
        print(f"({note})")
    return 0


def _recommend_geometry(args: argparse.Namespace, config: Config) -> tuple[Geometry, Path]:
    """`geometry_from_args`, with a plain refusal when the model folder has no config.json:
    no geometry is guessed (the reference K3 config does not ship with the appliance)."""
    if args.model_config is None:
        default = config.paths.models_dir / config.engine.model.replace("/", "--")
        if not (default / "config.json").is_file():
            raise ApplianceError(
                "model_config_missing",
                f"{default / 'config.json'} does not exist, so the model's geometry is unknown",
                "pass --model-config PATH (the checkpoint's config.json), or pull the weights "
                "first (`appliance weights pull`)", exit_code=EX_USAGE)
    return geometry_from_args(args, config)


def _find_profile(config: Config, name: str) -> Any:
    """A built-in without touching the database; a custom one from it when it is there."""
    from appliance.tuning.profiles import ProfileError, builtin_profile
    from appliance.tuning.store import find_profile

    found = builtin_profile(name)
    if found is not None:
        return found
    db = _open_database(config)
    if db is None:
        raise ProfileError(
            "name", f"{name!r} is not a built-in profile, and custom profiles need the "
            "database, which is missing or not migrated",
            "see `appliance tune profiles`; run `appliance migrate` if custom profiles were "
            "created", code="profile_not_found", status=404)
    try:
        return db.call(lambda s: find_profile(s, name))
    finally:
        db.dispose()


def _custom_profiles(config: Config) -> tuple[list[Any], str]:
    from appliance.tuning.store import list_custom

    db = _open_database(config)
    if db is None:
        return [], "custom profiles not shown: the database is missing or not migrated"
    try:
        return [stored.profile for stored in db.call(list_custom)], ""
    finally:
        db.dispose()


def _open_database(config: Config) -> Any:
    """The database when it exists and is at this release's schema; else None. A SQLite file
    that does not exist is not created (a CLI lookup must not leave an empty database)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from appliance.db.database import Database, normalise_url
    from appliance.db.schema import schema_state
    from appliance.resources import migrations_dir

    url = make_url(normalise_url(config.database_url))
    if url.get_backend_name() == "sqlite" and (
            not url.database or url.database == ":memory:" or not Path(url.database).is_file()):
        return None
    db = Database(config.database_url)
    try:
        if schema_state(db, migrations_dir()).at_head:
            return db
    except SQLAlchemyError:
        pass
    db.dispose()
    return None


COMMANDS: dict[str, tuple[str, AddArguments, Handler]] = {
    "predict": ("state slots, KV rows and running requests for one launch", _add_predict,
                predict),
    "recommend": ("the ratio (or pin) that serves a workload profile best", _add_recommend,
                  recommend_command),
    "profiles": ("list the workload profiles, or show one", _add_profiles, profiles_command),
}
