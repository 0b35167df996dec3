"""The Weights page: the active manifest, readiness for the engine, the job in flight with
its total and per-file progress, and the actions (pull, quick and full verification, import,
cancel).

The status card (`partials/weights_status.html`) polls `/weights/status` itself: every second
while a job runs, every five seconds otherwise (each answer sets the next interval, since it
replaces the polling element). The file table rides along as an out-of-band swap. The action
forms sit outside the polled card, so a poll never wipes what is being typed; an action answers
with its own result (inline, next to its form) and the fresh status and file table (out of
band). Without htmx, the forms post normally and get the whole page back with the result.
Every console action is audited like the API's, with `via: console`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from litestar import get, post
from litestar.params import URLEncodedBody
from litestar.response import Template

from appliance.auditing import audit
from appliance.auth.middleware import client_address
from appliance.config import check_endpoint, check_repo_id
from appliance.errors import ApplianceError
from appliance.runtime import Runtime, runtime_of
from appliance.sizes import rate_text
from appliance.ui.login import AdminRequest
from appliance.ui.pages import GUARDED
from appliance.ui.templating import when
from appliance.weights.views import FileState, FileView, WeightsView, bytes_text

# Files first that are moving, then those needing attention, then those waiting, then done.
_ORDER: dict[str, int] = {
    FileState.DOWNLOADING: 0, FileState.RETRYING: 0, FileState.STALLED: 0,
    FileState.VERIFYING: 0, FileState.FAILED: 1, FileState.MISSING: 1, FileState.QUEUED: 2,
    FileState.VERIFIED: 3,
}
# States whose files are in flight (their rate and ETA mean something).
MOVING = frozenset({FileState.DOWNLOADING.value, FileState.RETRYING.value,
                    FileState.STALLED.value, FileState.VERIFYING.value})
# The order the per-state counts are shown in.
COUNT_ORDER = (FileState.DOWNLOADING, FileState.VERIFYING, FileState.RETRYING,
               FileState.STALLED, FileState.FAILED, FileState.MISSING, FileState.QUEUED,
               FileState.VERIFIED)
QUICK_PROBLEMS_SHOWN = 5


def sort_files(files: tuple[FileView, ...]) -> list[FileView]:
    """Active files first (downloading, retrying, stalled, verifying), then failed or
    missing, queued, verified; by path within each group."""
    return sorted(files, key=lambda f: (_ORDER.get(f.state, 2), f.path))


def state_counts(view: WeightsView) -> list[tuple[str, int]]:
    """(state, count) for the states that have files, in a fixed order."""
    counts = view.counts
    shown = [(s.value, counts.get(s.value, 0)) for s in COUNT_ORDER]
    extra = [(s, n) for s, n in counts.items() if s not in {v for v, _ in shown}]
    return [(s, n) for s, n in (*shown, *extra) if n]


def sentence(text: str) -> str:
    """A message as a sentence: first letter up, unless it starts with a name that must
    keep its case (a repo id, a path, a file name)."""
    first = text.split(" ", 1)[0]
    if not text or any(c in first for c in "/@._") or not first[:1].islower():
        return text
    return text[:1].upper() + text[1:]


@dataclass(frozen=True)
class Readiness:
    """May the engine use these weights, in one sentence for the operator."""

    ok: bool
    text: str
    hint: str = ""
    problems: tuple[str, ...] = ()


def readiness(view: WeightsView, engine_model: str) -> Readiness:
    if view.repo_id is None:
        return Readiness(False, "Not ready for the engine: no manifest yet.",
                         "pull the weights from the Hub (or a mirror), or import a copy from a "
                         "directory with its manifest")
    if view.repo_id != engine_model:
        return Readiness(False, f"Not ready for the engine: the active manifest is of "
                         f"{view.repo_id}, but the engine serves {engine_model}.",
                         f"pull {engine_model}, or set engine.model to the model you mean")
    if view.disk_problems:
        count = len(view.disk_problems)
        return Readiness(False, f"Not ready for the engine: {count} file"
                         f"{'s' * (count != 1)} changed on disk since "
                         f"{'they were' if count != 1 else 'it was'} proven.",
                         "fetch the damaged files again (or copy them back), then run a "
                         "full verification", _shown(view.disk_problems))
    verification = view.verification
    if (verification is not None and not verification.ok and not view.busy
            and view.full_verified_at is None):  # not yet repaired
        return Readiness(False, "Not ready for the engine: the full verification of "
                         f"{when(verification.at)} found {len(verification.mismatches)} "
                         "damaged file" + "s" * (len(verification.mismatches) != 1) + ".",
                         "fetch the damaged files again (they were moved to the model "
                         "directory's .quarantine/ folder, not deleted)"
                         if view.refetchable else "copy those files again and re-import",
                         _shown(tuple(m.sentence() for m in verification.mismatches)))
    if view.full_verified_at is None:
        pending = sum(1 for f in view.files if f.state != FileState.VERIFIED)
        hint = ("the job in flight proves them" if view.busy else
                "pull again (finished files are kept), or run a full verification")
        return Readiness(False, f"Not ready for the engine: {pending} of {len(view.files)} "
                         "files are not verified yet.", hint)
    if view.quick_ok is False:
        return Readiness(False, "Not ready for the engine: the quick check failed "
                         f"{when(view.quick_checked_at)}.",
                         "fetch the damaged files again (or re-import them)",
                         _shown(view.quick_problems))
    verified = f"fully verified {when(view.full_verified_at)}"
    if view.quick_ok is None:
        return Readiness(True, f"Ready for the engine: {verified}; the quick check runs "
                         "before every launch.")
    return Readiness(True, f"Ready for the engine: {verified}, quick check passed "
                     f"{when(view.quick_checked_at)}.")


def _shown(problems: tuple[str, ...]) -> tuple[str, ...]:
    shown = problems[:QUICK_PROBLEMS_SHOWN]
    if len(problems) > len(shown):
        shown = (*shown, f"and {len(problems) - len(shown)} more")
    return shown


@dataclass(frozen=True)
class Outcome:
    """What an action answered, shown next to its form."""

    notice: str = ""
    error: str = ""
    hint: str = ""
    status: int = 200


@dataclass
class PullForm:
    repo: str = ""
    revision: str = ""
    endpoint: str = ""


@dataclass
class VerifyForm:
    rehash: str = ""


@dataclass
class ImportForm:
    directory: str = ""
    manifest: str = ""


@dataclass
class Forms:
    """The values the action forms show: the configured defaults, or what was posted."""

    pull: PullForm = field(default_factory=PullForm)
    imports: ImportForm = field(default_factory=ImportForm)
    rehash: bool = False


def _defaults(runtime: Runtime) -> Forms:
    weights = runtime.config.weights
    return Forms(pull=PullForm(repo=runtime.config.weights_repo, revision=weights.revision,
                               endpoint=weights.endpoint))


async def _status_context(runtime: Runtime, *, status_oob: bool, files_oob: bool,
                          error: str = "", hint: str = "") -> dict[str, Any]:
    view = await runtime.weights.status()
    return {
        "w": view, "files": sort_files(view.files), "counts": state_counts(view),
        "ready": readiness(view, runtime.config.engine.model), "rate": rate_text,
        "sentence": sentence, "moving": MOVING, "bytes_text": bytes_text,
        "status_oob": status_oob, "files_oob": files_oob, "error": error, "error_hint": hint,
    }


def _htmx(request: AdminRequest) -> bool:
    return bool(request.headers.get("hx-request"))


async def _page(request: AdminRequest, *, forms: Forms | None = None,
                results: dict[str, Outcome] | None = None, error: str = "", hint: str = "",
                status_code: int = 200) -> Template:
    runtime = runtime_of(request)
    context = await _status_context(runtime, status_oob=False, files_oob=False, error=error,
                                    hint=hint)
    return Template("pages/weights.html", status_code=status_code, context={
        **context, "nav": "weights", "forms": forms or _defaults(runtime),
        "results": results or {}})


@get("/weights", **GUARDED)
async def weights_page(request: AdminRequest) -> Template:
    return await _page(request)


@get("/weights/status", **GUARDED)
async def weights_status_partial(request: AdminRequest) -> Template:
    context = await _status_context(runtime_of(request), status_oob=False, files_oob=True)
    return Template("partials/weights_status.html", context=context)


Work = Callable[[], Awaitable[Outcome]]


async def _act(request: AdminRequest, key: str, action: str, target: str,
               detail: dict[str, Any], work: Work, forms: Forms) -> Template:
    """Run one action and answer with its outcome. A refusal (ApplianceError) is shown with
    its reason and hint, and audited as denied; the answer's status is the refusal's. An
    action that ran and found a fault (a failed quick check) is audited as failed."""
    runtime = runtime_of(request)
    try:
        outcome = await work()
    except ApplianceError as exc:
        outcome = Outcome(error=exc.message, hint=exc.hint, status=exc.status)
    await audit(runtime, actor=request.user.username, address=client_address(request),
                action=f"weights.{action}", target=target,
                outcome=("denied" if outcome.status >= 400 else "failed" if outcome.error
                         else "ok"),
                detail={"via": "console", **detail,
                        **({"refused": outcome.error} if outcome.status >= 400 else {})})
    if not _htmx(request):
        return await _page(request, forms=forms, results={key: outcome},
                           status_code=outcome.status)
    context = await _status_context(runtime, status_oob=True, files_oob=True)
    return Template("partials/weights_result.html", status_code=outcome.status,
                    context={**context, "r": outcome})


def _bad_input(key: str, value: str, expected: str) -> ApplianceError:
    return ApplianceError("weights_bad_input", f"{key} {value!r} is not {expected}",
                          f"fix {key}, or clear the field to use the [weights] configuration",
                          status=422)


@post("/weights/pull", **GUARDED)
async def weights_pull_ui(request: AdminRequest, data: URLEncodedBody[PullForm]) -> Template:
    runtime = runtime_of(request)
    weights = runtime.config.weights
    form = PullForm(repo=data.repo.strip(), revision=data.revision.strip(),
                    endpoint=data.endpoint.strip())
    repo = form.repo or runtime.config.weights_repo
    revision = form.revision or weights.revision
    endpoint = form.endpoint or weights.endpoint

    async def work() -> Outcome:
        for key, value, check in (("repo", form.repo, check_repo_id),
                                  ("endpoint", form.endpoint, check_endpoint)):
            if value and (expected := check(value)):
                raise _bad_input(key, value, expected)
        await runtime.weights.pull(actor=request.user.username, repo=form.repo or None,
                                   revision=form.revision or None,
                                   endpoint=form.endpoint or None)
        return Outcome(notice=f"Pull of {repo}@{revision} from {endpoint} started.")

    return await _act(request, "pull", "pull", repo,
                      {"revision": revision, "endpoint": endpoint}, work,
                      Forms(pull=form))


@post("/weights/verify/quick", **GUARDED)
async def weights_verify_quick_ui(request: AdminRequest) -> Template:
    runtime = runtime_of(request)
    ok: dict[str, bool] = {}

    async def work() -> Outcome:
        report = await runtime.weights.quick_verify()
        if report is None:
            raise ApplianceError("weights_no_manifest", "no weights manifest is recorded yet",
                                 "pull or import the weights first", status=409)
        ok["ok"] = report.ok
        took = f"{report.elapsed_seconds * 1000:.0f} ms"
        if report.ok:
            return Outcome(notice=f"Quick check passed: {report.files_checked} files and "
                           f"{report.shards_checked} shard headers checked in {took}.")
        problems = "; ".join(f"{p.path}: {p.message}" for p in
                             report.problems[:QUICK_PROBLEMS_SHOWN])
        more = len(report.problems) - QUICK_PROBLEMS_SHOWN
        return Outcome(error=f"Quick check failed: {problems}"
                       + (f" (and {more} more)" if more > 0 else ""),
                       hint="fetch the damaged files again (the button in the status above, or "
                       "`appliance weights refetch`), or re-import them")

    return await _act(request, "verify", "verify", "quick", ok, work, _defaults(runtime))


@post("/weights/verify/full", **GUARDED)
async def weights_verify_full_ui(request: AdminRequest,
                                 data: URLEncodedBody[VerifyForm]) -> Template:
    runtime = runtime_of(request)
    rehash = data.rehash == "yes"

    async def work() -> Outcome:
        await runtime.weights.verify_full(actor=request.user.username, rehash=rehash)
        return Outcome(notice="Full verification started" + (
            ", re-hashing every file." if rehash else
            "; files unchanged since they were proven are not hashed again."))

    forms = _defaults(runtime)
    forms.rehash = rehash
    return await _act(request, "verify", "verify", "full", {"rehash": rehash}, work, forms)


@post("/weights/refetch", **GUARDED)
async def weights_refetch_ui(request: AdminRequest) -> Template:
    """Fetch the damaged files again: a separate, audited step after a verification (or the
    quick check) found damage; from the endpoint configured now."""
    runtime = runtime_of(request)
    endpoint = runtime.config.weights.endpoint

    async def work() -> Outcome:
        view = await runtime.weights.refetch(actor=request.user.username)
        return Outcome(notice=f"Fetching the damaged files of {view.repo_id}@"
                       f"{(view.commit or '')[:12]} again from {endpoint}.")

    return await _act(request, "verify", "refetch", runtime.config.weights_repo,
                      {"endpoint": endpoint}, work, _defaults(runtime))


@post("/weights/import", **GUARDED)
async def weights_import_ui(request: AdminRequest, data: URLEncodedBody[ImportForm]) -> Template:
    runtime = runtime_of(request)
    form = ImportForm(directory=data.directory.strip(), manifest=data.manifest.strip())

    async def work() -> Outcome:
        directory = Path(form.directory)
        manifest = Path(form.manifest) if form.manifest else None
        if not form.directory or not directory.is_absolute() or (
                manifest is not None and not manifest.is_absolute()):
            raise ApplianceError("weights_bad_input", "import paths must be absolute (they "
                                 "are read by the daemon, on the box)",
                                 "give the directory (and the manifest, if any) as absolute "
                                 "paths", status=422)
        await runtime.weights.import_dir(directory, actor=request.user.username,
                                         manifest_file=manifest)
        return Outcome(notice=f"Import from {directory} started.")

    forms = _defaults(runtime)
    forms.imports = form
    return await _act(request, "import", "import", form.directory,
                      {"manifest": form.manifest}, work, forms)


@post("/weights/cancel", **GUARDED)
async def weights_cancel_ui(request: AdminRequest) -> Template:
    """Cancel the job in flight; the answer is the status card (and the file table out of
    band), with the reason when there was nothing to cancel."""
    runtime = runtime_of(request)
    error = hint = ""
    status_code = 200
    if (await runtime.weights.status()).busy:
        await runtime.weights.cancel(actor=request.user.username)
        await audit(runtime, actor=request.user.username, address=client_address(request),
                    action="weights.cancel", target="", detail={"via": "console"})
    else:
        error, hint, status_code = ("no weights job is running", "nothing to cancel", 409)
    if not _htmx(request):
        return await _page(request, error=error, hint=hint, status_code=status_code)
    context = await _status_context(runtime, status_oob=False, files_oob=True, error=error,
                                    hint=hint)
    return Template("partials/weights_status.html", context=context, status_code=status_code)
