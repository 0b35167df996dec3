"""The one redaction table: what must never leave the box in a support bundle, and how it is
recognised.

Two kinds of rule, applied to every text file before it enters an archive:

- **By value**: the secrets this box holds — the HMAC key (`secrets/server.key`), the engine's
  API key (`secrets/engine-api.key`), every configuration value `describe()` masks with
  `show=` (`secret_keys()`: the database URL, the Hub token, the alert webhook URL …), and the
  contents of every configured secret file (`secret_files()`: `weights.token_file` …).
  Values are replaced wherever they appear, whatever the surrounding format.
- **By pattern** (`PATTERNS`): credentials and user content of known shapes, wherever they came
  from — gateway keys (`sk-…`), admin API tokens (`apt_…`), Hub tokens (`hf_…`), bearer and
  basic authorization, argon2 password hashes, session and CSRF cookies, passwords in URLs,
  `password=`/`token=`-style assignments, secrets in URL query strings, and prompt text
  (SGLang's `--log-requests` lines, and `content`/`prompt`/`messages`-style fields).

Each replacement reads `[redacted: <what>]`, so a reader knows something was there and what
kind. Invariant: a value redacted by value is replaced before the patterns run, longest first,
so a secret that contains another is never half-replaced. Prompt text that appears with no
marker at all (a bare sentence in a log) cannot be told from any other line; the appliance
itself never logs prompts, and SGLang only does with `--log-requests`, whose lines are caught.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from appliance.config import SECTIONS, Config

MIN_VALUE_LENGTH = 4  # shorter "secrets" would redact ordinary words everywhere

_QUOTED = r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'"
_PROMPT_FIELDS = (r"content|prompt|prompts|text|input|inputs|query|messages|"
                  r"completion|output_text|reasoning_content|system|instructions")


@dataclass(frozen=True)
class Pattern:
    """A rule: `regex` matches; group 1 (when the regex has one) is kept, the rest replaced."""

    label: str
    regex: re.Pattern[str]


def _p(label: str, regex: str, flags: int = 0) -> Pattern:
    return Pattern(label, re.compile(regex, flags))


# Order matters: whole request-log lines first, then credentials of known shape, then the
# generic assignments that would otherwise catch their remains.
PATTERNS: tuple[Pattern, ...] = (
    # SGLang --log-requests: `Receive: obj=GenerateReqInput(text='…')`, `Finish: obj=…, out=…`.
    _p("request content", r"((?:Receive|Finish|Abort)\s*:\s*obj=).*"),
    _p("gateway key", r"\bsk-[A-Za-z0-9_-]{8,}"),
    _p("admin API token", r"\bapt_[A-Za-z0-9_-]{8,}"),
    _p("Hub token", r"\bhf_[A-Za-z0-9]{16,}"),
    _p("password hash", r"\$argon2(?:id|i|d)\$[^\s\"';]+"),
    _p("password hash", r"\$(?:2[aby]|5|6|y|scrypt|pbkdf2[\w-]*)\$[^\s\"',;]{16,}"),
    _p("session cookie", r"((?:appliance_session|appliance_csrf|session|csrftoken)=)[^\s;\"',&]+"),
    _p("cookie", r"((?:^|[\s\"'])(?:set-)?cookie[\"']?\s*[:=]\s*[\"']?)[^\r\n\"']+", re.I),
    _p("credential", r"(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{6,}", re.I),
    _p("URL password", r"(\b[a-z][a-z0-9+.-]*://[^/\s:@\"']*:)[^@\s/\"']+(?=@)", re.I),
    _p("secret in URL", r"([?&](?:token|access_token|key|api_key|apikey|sig|signature|secret|"
       r"password|auth|code)=)[^&\s\"'#]+", re.I),
    _p("secret", r"((?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|"
       r"private[_-]?key|webhook[_-]?url)[\"']?\s*[:=]\s*)(?!\"?'?\[redacted)"
       r"(?:" + _QUOTED + r"|[^\s\"',;&}\]]+)", re.I),
    # Prompt text as a field: JSON (`"content": "…"`), Python reprs (`text='…'`), key=value.
    _p("prompt text", r"([\"']?\b(?:" + _PROMPT_FIELDS + r")\b[\"']?\s*[:=]\s*)"
       r"(?!\"?'?\[redacted)(?:" + _QUOTED + r")", re.I),
    _p("prompt tokens", r"([\"']?\binput_ids\b[\"']?\s*[:=]\s*)\[[^\]]*\]?", re.I),
)


def marker(label: str) -> str:
    return f"[redacted: {label}]"


@dataclass
class Redactor:
    """Redacts text with the table above and the box's own secret values; counts what it did
    per label (for the bundle's README). Build it with `for_box(config)`."""

    values: dict[str, str] = field(default_factory=dict)  # secret value -> label
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, value: str | None, label: str) -> None:
        value = (value or "").strip()
        if len(value) >= MIN_VALUE_LENGTH:
            self.values.setdefault(value, label)

    def __call__(self, text: str) -> str:
        for value in sorted(self.values, key=len, reverse=True):
            found = text.count(value)
            if found:
                label = self.values[value]
                text = text.replace(value, marker(label))
                self.counts[label] += found
        for pattern in PATTERNS:
            text = pattern.regex.sub(self._replacer(pattern), text)
        return text

    def _replacer(self, pattern: Pattern) -> Callable[[re.Match[str]], str]:
        def replace(match: re.Match[str]) -> str:
            kept = match.group(1) if pattern.regex.groups else ""
            self.counts[pattern.label] += 1
            return f"{kept}{marker(pattern.label)}"

        return replace

    def summary(self) -> list[str]:
        """One line per kind redacted, most frequent first."""
        return [f"{count} x {label}" for label, count in self.counts.most_common()]


def secret_keys(config: Config) -> list[tuple[str, str]]:
    """(dotted key, raw value) of every string setting `describe()` masks (its `show=`
    changes the value): whatever the Settings page hides, a bundle hides too."""
    found = []
    for name in SECTIONS:
        section = getattr(config, name)
        for item in dataclasses.fields(section):
            value = getattr(section, item.name)
            show = item.metadata.get("show")
            if show is not None and isinstance(value, str) and value and show(value) != value:
                found.append((f"{name}.{item.name}", value))
    return found


def secret_files(config: Config) -> list[tuple[str, Path]]:
    """(dotted key, path) of every configured file that holds a secret or a token."""
    found = []
    for name in SECTIONS:
        section = getattr(config, name)
        for item in dataclasses.fields(section):
            value = getattr(section, item.name)
            if (isinstance(value, Path) and item.name.endswith("_file")
                    and ("secret" in item.name or "token" in item.name)):
                found.append((f"{name}.{item.name}", value))
    return found


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def for_box(config: Config, extra: Iterable[tuple[str, str]] = ()) -> Redactor:
    """A redactor that knows this box's secret values: the configuration's secret keys (and
    their secret parts: a database URL's password, a webhook's path and query), the Hub
    token file, `server.key` and `engine-api.key` (read when this user may; a file that
    cannot be read cannot leak either). `extra`: (value, label) pairs to add."""
    from urllib.parse import urlsplit

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    redactor = Redactor()
    secrets_dir = config.paths.state_dir / "secrets"
    redactor.add(_read(secrets_dir / "server.key"), "server secret")
    redactor.add(_read(secrets_dir / "engine-api.key"), "engine API key")
    redactor.add(config.weights.token, "Hub token")
    for key, path in secret_files(config):
        redactor.add(_read(path), key)
    url = config.database.url
    if url:
        redactor.add(url, "database URL")
        try:
            parsed = make_url(url)
            redactor.add(parsed.password if isinstance(parsed.password, str) else None,
                         "database password")
            in_query = parsed.query.get("password")
            redactor.add(in_query if isinstance(in_query, str) else None, "database password")
        except (ArgumentError, ValueError):
            pass
    hook = config.health.webhook_url
    if hook:
        redactor.add(hook, "webhook URL")
        try:
            parts = urlsplit(hook)
            if parts.path not in ("", "/"):
                redactor.add(parts.path, "webhook URL")
            redactor.add(parts.query, "webhook URL")
            redactor.add(parts.password, "webhook URL")
        except ValueError:
            pass
    for key, value in secret_keys(config):  # after the labelled ones above: theirs win
        redactor.add(value, key)
    for value, label in extra:
        redactor.add(value, label)
    return redactor
