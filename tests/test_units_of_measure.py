"""One language for every figure: SI sizes, GiB only for GPU memory, UTC times to the second.

- appliance/sizes.py, the one formatting module, unit by unit.
- Every console page over real HTTP (the health rig: eight fake GPUs, an hour of samples, every
  check run, events, audit rows and a key), as an operator would read them: no page says
  KiB, MiB or TiB, so none shows "MiB" beside "GB" for the same files; GiB only where GPU
  memory is shown. The Engine page's memory card, from a real SGLang startup log, shows GiB
  and says once that SGLang's "GB" are GiB, with KDA and MLA explained.
- Words: a hint's backticks become <code>, counts take their plural, and the engine CLI names
  its `--yes` flag where the API would say confirm=true.
"""

# The server rig's fixtures are imported from tests.test_health_api; the tests name them again.
# ruff: noqa: F811

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.plugins.jinja import JinjaTemplateEngine
from sqlalchemy.orm import Session

from appliance.db.journal import add_audit, add_event
from appliance.engine import logparse
from appliance.engine.cli import checked
from appliance.engine.states import EngineState
from appliance.engine.supervisor import EngineStatus
from appliance.errors import ApplianceError
from appliance.gateway.keys import create_key
from appliance.health.host_checks import host_checks
from appliance.health.model import HostFigures
from appliance.resources import templates_dir
from appliance.runtime import Runtime
from appliance.sizes import (
    bytes_text,
    duration_text,
    gib_text,
    plural,
    rate_text,
    tokens_text,
    when_text,
)
from appliance.tuning.profiles import format_tokens
from appliance.ui.templating import configure_templates, ticks
from appliance.ui.words import action_text, detail_text, job_text
from tests.conftest import Console, csrf
from tests.test_health_api import API, gpus, runtime, seed_hour  # noqa: F401 - fixtures
from tests.test_tuning_api import write_k3

PAGES = ("/", "/engine", "/weights", "/tuning", "/qualify", "/usage", "/keys", "/health",
         "/events", "/audit", "/settings", "/account/password")
LOGS = Path(__file__).parent / "data" / "engine_logs"
BINARY_NOT_GIB = re.compile(r"\b(?:KiB|MiB|TiB)\b")
AT = dt.datetime(2026, 5, 1, 12, 0, 0, 123456, tzinfo=dt.UTC)


# --- appliance/sizes.py -------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (999, "999 B"), (1000, "1.00 kB"), (96_210_000, "96.21 MB"),
    (100 * 2**20, "104.86 MB"), (1_560 * 10**9, "1.56 TB"), (2**40, "1.10 TB"),
    (3 * 10**15, "3.00 PB"), (-2_000_000, "-2.00 MB"),
])
def test_bytes_are_si(n: int, text: str) -> None:
    assert bytes_text(n) == text


def test_gpu_memory_is_gib_and_rates_are_si() -> None:
    assert gib_text(275_040 * 2**20) == "268.6 GiB"
    assert gib_text(1700 * 2**30) == "1,700.0 GiB"
    assert [rate_text(v) for v in (None, 0, 5_000, 250_000, 12_345_678, 2.5e9)] == [
        "—", "—", "< 0.01 MB/s", "0.25 MB/s", "12.3 MB/s", "2.50 GB/s"]


def test_times_are_utc_to_the_second_and_durations_are_words() -> None:
    assert when_text(AT) == "2026-05-01 12:00:00 UTC"
    assert when_text(AT.astimezone(dt.timezone(dt.timedelta(hours=2)))) == (
        "2026-05-01 12:00:00 UTC")
    assert when_text(AT.replace(tzinfo=None)) == "2026-05-01 12:00:00 UTC"  # naive is UTC
    assert when_text(None) == "—"
    assert [duration_text(s) for s in (None, 0.4, 1, 45, 60, 303, 3600, 7500, 90_000, 3 * 86400)
            ] == ["—", "0 seconds", "1 second", "45 seconds", "1 minute", "5 minutes 3 seconds",
                  "1 hour", "2 hours 5 minutes", "1 day 1 hour", "3 days"]


def test_token_counts_have_one_form() -> None:
    # The Tuning page's "KV 16M / 9.7M tokens" and the Engine page's capacity, one function.
    assert [tokens_text(n) for n in (900, 131_072, 10_190_336, 17_114_112, 1_258_291)] == [
        "900", "128K", "9.7M", "16M", "1.2M"]
    assert format_tokens is tokens_text  # the tuning modules' name for it


def test_a_line_set_in_gib_is_said_in_gb_with_the_settings_own_figure(
        runtime: Runtime) -> None:
    health = runtime.config.health  # models_free_warn_gib = 100
    figures = HostFigures(at=AT, models_free_bytes=90 * 2**30, models_total_bytes=2 * 10**12,
                          state_free_bytes=10**12, state_total_bytes=2 * 10**12,
                          shm_free_bytes=10**11, shm_total_bytes=10**11,
                          memory_available_bytes=10**12, memory_total_bytes=2 * 10**12,
                          load1=0.1, cpu_count=8, daemon_rss_bytes=10**8)
    models = next(c for c in host_checks(figures, health) if c.id == "host.models_disk")
    assert health.models_free_warn_gib == 100
    assert "under the 107.37 GB warning line (100 GiB as configured)" in models.summary


def test_speeds_are_tokens_per_second_everywhere(pages: dict[str, str]) -> None:
    # "13 tokens/s" beside "13 tok/s": one way to say it on every page.
    assert not {path for path, text in pages.items() if "tok/s" in text}


def test_plurals() -> None:
    assert [plural(n, "check") for n in (0, 1, 2, 1024)] == [
        "0 checks", "1 check", "2 checks", "1,024 checks"]
    assert plural(2, "entry", "entries") == "2 entries"


# --- words ----------------------------------------------------------------------------------------


def test_backticks_become_code_and_nothing_else_is_trusted() -> None:
    assert ticks("find it (`ps aux --sort=-rss | head`)") == (
        "find it (<code>ps aux --sort=-rss | head</code>)")
    assert ticks("a <b> and a stray ` tick") == "a &lt;b&gt; and a stray  tick"


def test_the_engine_cli_names_its_flag_not_the_api_field() -> None:
    answer = httpx.Response(409, json={
        "code": "confirmation_required", "detail": "stop ends the running engine",
        "hint": "repeat with confirm=true (the console asks for you)"})
    with pytest.raises(ApplianceError) as refused:
        checked(answer)
    assert refused.value.hint == "repeat with --yes"
    other = httpx.Response(409, json={"code": "x", "detail": "d", "hint": "wait"})
    with pytest.raises(ApplianceError) as kept:
        checked(other)
    assert kept.value.hint == "wait"


# --- every page, as served ------------------------------------------------------------------------


def seed_rows(runtime: Runtime) -> None:
    """Events, audit rows and an API key with long texts, as a month of use leaves them."""
    now = runtime.clock.now()

    def write(s: Session) -> None:
        for n in range(30):
            at = now - dt.timedelta(minutes=n)
            add_event(s, at=at, severity="warning" if n % 3 else "info", source="weights",
                      message=f"downloaded model-{n:05d}-of-00064.safetensors (4.99 GB) from "
                      "https://huggingface.co/moonshotai/Kimi-K3/resolve/0123456789abcdef")
            add_audit(s, at=at, actor="alice", action="engine.restart", address="192.0.2.17",
                      target="engine", detail={"reason": "tuning applied", "ratio": 0.5,
                                               "profile": "long-context-agents"})
        add_audit(s, at=now, actor="alice", action="auth.password_change", target="alice",
                  detail={"bootstrap_file_removed": True})
        create_key(s, runtime.secret, name="research cluster batch jobs",
                   owner="alice@example.org", by="alice", now=now)
        # A long name widens the Usage page's key filter (it made the page 453 px wide).
        create_key(s, runtime.secret, name="Key Alpha for the nightly evaluation of models",
                   owner="", by="alice", now=now)

    runtime.db.call(write)


CODE_NAME = re.compile(r"<(\w+)\b[^>]*\bdata-code-name\b[^>]*>.*?</\1>", re.S)


def visible_text(html: str) -> str:
    """What a person reads: tags, scripts and attribute values dropped, and the exact code
    names a page keeps one click away for support (elements marked data-code-name: the raw
    detail inside a <details>)."""
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    html = CODE_NAME.sub(" ", html)
    return re.sub(r"<[^>]+>", " ", html)


@pytest.fixture
def pages(runtime: Runtime, logged_in: Console) -> dict[str, str]:
    seed_hour(runtime)
    seed_rows(runtime)
    write_k3(runtime.config)
    ran = logged_in.http.post(f"{API}/check", headers=csrf(logged_in))
    assert ran.status_code == 200, ran.text
    shown: dict[str, str] = {}
    for path in PAGES:
        answer = logged_in.http.get(path)
        assert answer.status_code == 200, (path, answer.text[:300])
        shown[path] = visible_text(answer.text)
    return shown


# appliance/config.py (another owner's, being edited) documents weights.bandwidth_limit_mib_s
# as "download cap in MiB/s": the key's own unit, shown in the Settings page's Meaning column.
SETTINGS_DOC = "download cap in MiB/s"


def test_no_page_speaks_kib_mib_or_tib(pages: dict[str, str]) -> None:
    found = {path: sorted(set(BINARY_NOT_GIB.findall(text.replace(SETTINGS_DOC, ""))))
             for path, text in pages.items()}
    assert not {path: units for path, units in found.items() if units}
    both = [path for path, text in pages.items() if "MiB" in text and re.search(r"\bGB\b", text)]
    assert not both, f"MiB beside GB on {both}"


def test_the_figures_are_si_except_gpu_memory(pages: dict[str, str]) -> None:
    dashboard = pages["/"]
    assert re.search(r"Memory\s+[\d.]+ (?:kB|MB|GB)", dashboard)  # the daemon's memory
    assert re.search(r"[\d.]+ (?:GB|TB)\s+of\s+[\d.]+ (?:GB|TB)", dashboard)  # the volumes
    assert re.search(r"[\d.]+ / [\d,.]+ GiB", dashboard)  # GPU memory, as nvidia-smi
    assert re.search(r"\d+\.\d\d GiB\s+per GPU", pages["/tuning"])
    assert re.search(r"RAM available", pages["/health"])
    every = " ".join(pages.values())
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", every)  # no raw ISO
    assert not re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d", every)  # no microseconds
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", pages["/events"])
    ticked = [path for path, text in pages.items() if "`" in text]
    assert not ticked, f"literal backticks on {ticked}"
    assert not re.search(r"\b1 checks\b", pages["/health"])


# --- the Engine page's memory card ---------------------------------------------------------------


def _engine_card(**status: Any) -> str:
    engine = JinjaTemplateEngine(directory=templates_dir())
    configure_templates(engine)
    context: dict[str, Any] = {
        "engine": EngineStatus(since=AT, message="m", **status), "cost": "a start takes long",
        "error": "", "error_hint": "", "runs": [], "oob_runs": False, "shows_progress": True,
        "actions_offered": [], "stop_facts": [], "log_run": None}
    return visible_text(engine.engine.get_template("partials/engine_status.html").render(context))


def test_the_engine_memory_card_is_gib_and_says_what_sglang_means_by_gb() -> None:
    log = logparse.parse_text((LOGS / "k3_startup.sample.log").read_text())
    card = _engine_card(state=EngineState.READY, log=log)
    assert re.search(r"\d+\.\d\d GiB for [\d,]+ slots", card)
    assert re.search(r"\d+\.\d\d GiB =\s+[\d.]+[KM]?\s+tokens", card)
    assert card.count("SGLang's log says “GB” for these same GiB") == 1
    assert "KDA (Kimi Delta Attention, a linear-attention layer with a fixed-size state)" in card
    assert "MLA (multi-head latent attention, whose KV cache grows with the context)" in card
    assert not re.search(r"\d GB\b", card)


def test_the_weights_being_read_are_si() -> None:
    card = _engine_card(state=EngineState.LOADING_WEIGHTS, percent=40.0,
                        bytes_read=40 * 2**20, weights_bytes=1_560 * 10**9, eta_seconds=5400,
                        eta_basis="from the read rate")
    assert "41.94 MB of 1.56 TB read" in card and "about 1 hour 30 minutes left" in card
    assert not BINARY_NOT_GIB.search(card)


# --- words from the code -------------------------------------------------------------------------

# Names from the code an operator should not have to read: audit actions, JSON details, job
# ids, SGLang's field and flag names, a configuration's hash. The Settings page lists the
# configuration's own keys (the file's words) and is checked for the rest only.
CODE_WORDS = re.compile(r"auth\.password_change|engine\.restart|bootstrap_file_removed|\{&#34;|"
                        r"\{\"|health_(?:gpus|engine|host|weights|prune)|purge_\w+|backup_tick|"
                        r"max_running_requests|mamba_full_memory_ratio|\bspec [0-9a-f]{8,}")
CONFIG_KEYS = re.compile(r"\b[a-z]+\.[a-z_]+\b")


def test_no_page_shows_the_codes_own_words(pages: dict[str, str]) -> None:
    found = {path: sorted(set(CODE_WORDS.findall(
                 CONFIG_KEYS.sub(" ", text) if path == "/settings" else text)))
             for path, text in pages.items()}
    assert not {path: words for path, words in found.items() if words}
    assert "Password changed" in pages["/audit"]
    assert "bootstrap file removed: yes" in pages["/audit"]
    assert "engine health check" in pages["/"]


def test_the_exact_names_stay_one_click_away(logged_in: Console, runtime: Runtime) -> None:
    seed_rows(runtime)
    audit = logged_in.http.get("/audit").text
    assert 'title="auth.password_change"' in audit
    assert re.search(r"<details class=\"audit-detail\"><summary>bootstrap file removed: yes"
                     r"</summary><code[^>]*>\{&#34;bootstrap_file_removed&#34;: true\}", audit)
    assert 'title="health_engine"' in logged_in.http.get("/").text


def test_words_for_names_the_table_does_not_know() -> None:
    assert action_text("weights.prewarm_cancel") == "Weights prewarm cancel"
    assert job_text("engine-action-12") == "scheduled engine action #12"
    assert job_text("some_new_job") == "some new job"
    assert detail_text({"ratio": 0.5, "ok": False, "gpus": [0, 1], "none": None}) == (
        "ratio: 0.5; ok: no; gpus: 0, 1; none: —")
