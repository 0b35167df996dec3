"""The one redaction table: what must never leave the box in a support bundle, and how it is
recognised.

Two kinds of rule, applied to every text file before it enters an archive:

- **By value**: the secrets this box holds — the HMAC key (`secrets/server.key`), the engine's
  API key (`secrets/engine-api.key`), every configuration value `describe()` masks with
  `show=` (`secret_keys()`: the database URL, the Hub token, the alert webhook URL …), and the
  contents of every configured secret file (`secret_files()`: `weights.token_file`,
  `backup.passphrase_file` …), which no collector reads either (`never_collected`).
  Values are replaced wherever they appear, whatever the surrounding format.
- **By pattern** (`PATTERNS`): credentials and user content of known shapes, wherever they came
  from — PEM private key blocks (wholesale), gateway keys (`sk-…`), admin API tokens
  (`apt_…`), Hub tokens (`hf_…`), cell join tokens (`acj_…`) and peer credentials (`acp_…`),
  bearer and basic authorization, argon2 password hashes, session and CSRF cookies,
  passwords in URLs, `password=`/`token=`-style assignments, secrets in URL query strings,
  and prompt text (SGLang's `--log-requests` lines, and `content`/`prompt`/`messages`-style
  fields).

Each replacement reads `[redacted: <what>]`, so a reader knows something was there and what
kind. Invariants: a value redacted by value is replaced before the patterns run, longest
first, so a secret that contains another is never half-replaced; an assignment is redacted
only where its name is a whole word (`token=`, `api_key:`), never a word that merely ends
in one (`#new-token: 6`, `bucket_time_to_first_token`, `enable_streaming_session`), and a
number or a boolean is never taken for a secret; a quoted value stays quoted, and a JSON
file is redacted structurally (`Redactor.structured`), so what parsed before parses after.
Prompt text that appears with no marker at all (a bare sentence in a log) cannot be told from
any other line; the appliance itself never logs prompts, and SGLang only does with
`--log-requests`, whose lines are caught.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


# A name is a whole word: not preceded or followed by a letter, digit, "_" or "-", so
# `#new-token: 6` and `kt_max_deferred_experts_per_token` are not assignments of a token.
_CREDENTIAL_NAMES = (
    r"password|passwd|pwd|secret|client_secret|token|access_token|refresh_token|auth_token|"
    r"api_token|hf_token|id_token|api[_-]?key|admin_api_key|apikey|access[_-]?key|"
    r"private[_-]?key|secret[_-]?key|webhook[_-]?url|ssl_keyfile_password")
_WORD_START, _WORD_END = r"(?<![\w-])", r"(?![\w-])"
_PLAIN_VALUE = r"(?:None|null|True|False|true|false|\d{1,6})(?![\w.:/-])"
SECRET_NAME = re.compile(f"(?:{_CREDENTIAL_NAMES})", re.I)

# Order matters: whole request-log lines first, then credentials of known shape, then the
# generic assignments that would otherwise catch their remains.
PATTERNS: tuple[Pattern, ...] = (
    # A PEM private key (TLS, SSH, PKCS#8, encrypted or not), BEGIN to END as one, or to the
    # text's end when a tail or a cap cut its END off: no line of its base64 body survives.
    _p("private key", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?"
       r"(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S),
    # SGLang --log-requests: `Receive: obj=GenerateReqInput(text='…')`, `Finish: obj=…, out=…`.
    _p("request content", r"((?:Receive|Finish|Abort)\s*:\s*obj=).*"),
    _p("gateway key", r"\bsk-[A-Za-z0-9_-]{8,}"),
    _p("admin API token", r"\bapt_[A-Za-z0-9_-]{8,}"),
    _p("Hub token", r"\bhf_[A-Za-z0-9]{16,}"),
    _p("cell join token", r"\bacj_[A-Za-z0-9_-]{16,}"),
    _p("cell peer credential", r"\bacp_[0-9a-f]{8}_[A-Za-z0-9_-]{16,}"),
    _p("password hash", r"\$argon2(?:id|i|d)\$[^\s\"';]+"),
    _p("password hash", r"\$(?:2[aby]|5|6|y|scrypt|pbkdf2[\w-]*)\$[^\s\"',;]{16,}"),
    _p("session cookie", _WORD_START + r"((?:appliance_session|appliance_csrf|session|"
       r"csrftoken)=)[^\s;\"',&]+"),
    _p("cookie", r"((?:^|[\s\"'])(?:set-)?cookie[\"']?\s*[:=]\s*[\"']?)[^\r\n\"']+", re.I),
    _p("credential", r"(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{6,}", re.I),
    _p("URL password", r"(\b[a-z][a-z0-9+.-]*://[^/\s:@\"']*:)[^@\s/\"']+(?=@)", re.I),
    _p("secret in URL", r"([?&](?:token|access_token|key|api_key|apikey|sig|signature|secret|"
       r"password|auth|code)=)[^&\s\"'#]+", re.I),
    _p("secret", r"(" + _WORD_START + r"(?:" + _CREDENTIAL_NAMES + r")" + _WORD_END
       + r"[\"']?\s*[:=]\s*)(?!\"?'?\[redacted)(?!" + _PLAIN_VALUE + r")"
       r"(?:" + _QUOTED + r"|[^\s\"',;&})\]]+)", re.I),
    # Prompt text as a field: JSON (`"content": "…"`), Python reprs (`text='…'`), key=value.
    _p("prompt text", r"([\"']?\b(?:" + _PROMPT_FIELDS + r")\b[\"']?\s*[:=]\s*)"
       r"(?!\"?'?\[redacted)(?:" + _QUOTED + r")", re.I),
    _p("prompt tokens", r"([\"']?\binput_ids\b[\"']?\s*[:=]\s*)\[[^\]]*\]?", re.I),
)


CREDENTIAL_SHAPES = frozenset({"gateway key", "admin API token", "Hub token", "cell join token",
                               "cell peer credential"})


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
        text = self._by_value(text, marker)
        for pattern in PATTERNS:
            text = pattern.regex.sub(self._replacer(pattern, marker), text)
        return text

    def credentials(self, text: str, mark: Callable[[str], str] = marker) -> str:
        """Only this box's secret values and credentials of a known shape (`CREDENTIAL_SHAPES`),
        no prompt or assignment rules: for text that keeps its meaning and its format (a
        backup's event rows and configuration file). `mark` writes the replacement."""
        text = self._by_value(text, mark)
        for pattern in PATTERNS:
            if pattern.label in CREDENTIAL_SHAPES:
                text = pattern.regex.sub(self._replacer(pattern, mark), text)
        return text

    def _by_value(self, text: str, mark: Callable[[str], str]) -> str:
        for value in sorted(self.values, key=len, reverse=True):
            found = text.count(value)
            if found:
                label = self.values[value]
                text = text.replace(value, mark(label))
                self.counts[label] += found
        return text

    def _replacer(self, pattern: Pattern, mark: Callable[[str], str],
                  ) -> Callable[[re.Match[str]], str]:
        def replace(match: re.Match[str]) -> str:
            kept = match.group(1) if pattern.regex.groups else ""
            self.counts[pattern.label] += 1
            value = match.group(0)[len(kept):]
            quote = value[:1] if len(value) >= 2 and value[:1] in "\"'" \
                and value.endswith(value[:1]) else ""
            return f"{kept}{quote}{mark(pattern.label)}{quote}"  # a quoted value stays so

        return replace

    def structured(self, path: str, text: str) -> str:
        """`text` redacted as the file `path` is read: a JSON file value by value (a secret
        field's value becomes the marker string, every other string is redacted as text), so
        the result still parses; a TOML file as text, whose markers stay inside their quotes,
        checked to parse again (else replaced by a note: settings.txt has the values masked);
        anything else (or JSON that does not parse) as text."""
        if path.endswith(".json"):
            try:
                value = json.loads(text)
            except ValueError:
                return self(text)
            return json.dumps(self._walk(value), indent=2) + "\n"
        redacted = self(text)
        if path.endswith(".toml"):
            try:
                tomllib.loads(text)
            except tomllib.TOMLDecodeError:
                return redacted  # it did not parse before either: nothing to keep
            try:
                tomllib.loads(redacted)
            except tomllib.TOMLDecodeError:
                self.counts["configuration file (left out: its redaction would not parse)"] += 1
                return ("# left out: this file's redacted form would not parse as TOML; "
                        "config/settings.txt has every value, secrets masked\n")
        return redacted

    def _walk(self, value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {self(str(k)): self._walk(v, str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, key) for v in value]
        if isinstance(value, str):
            # Redacted with its name beside it, as the text rules see a field ("cookie": …,
            # "content": …); what comes back is one field again, or the whole value goes. A
            # field named like a secret (`api_key`, `HF_TOKEN`) goes whatever its value.
            try:
                found = json.loads(self(json.dumps({key: value})))
                (kept,) = found.values()
            except (ValueError, AttributeError):
                kept = None
            if kept is None or (value and SECRET_NAME.fullmatch(key)
                                and "[redacted" not in str(kept)):
                self.counts["secret"] += 1
                return marker("secret")
            return kept
        return value

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
                    and any(word in item.name for word in ("secret", "token", "passphrase"))):
                found.append((f"{name}.{item.name}", value))
    return found


def never_collected(config: Config) -> frozenset[Path]:
    """Files no collector may read, whatever folder they lie in: the configured secret files
    (`secret_files`: the backup passphrase, the OIDC client secret, the Hub token file) and
    the TLS private keys. Resolved, so a link or a `..` to one is still one."""
    paths = [path for _, path in secret_files(config)]
    paths += [key for key in (config.server.tls_key, config.gateway.tls_key) if key is not None]
    return frozenset(path.resolve() for path in paths)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _other_secrets(secrets_dir: Path) -> list[tuple[Path, str]]:
    """Every other file under `secrets/` (a cell head's `cell/member-N.key` credentials, and
    whatever a later release keeps there): a file in that folder is a secret by where it is."""
    try:
        found = sorted(p for p in secrets_dir.rglob("*") if p.is_file() and not p.is_symlink())
    except OSError:
        return []
    return [(p, "cell member credential" if p.parent.name == "cell" else
             f"secret file {p.relative_to(secrets_dir)}") for p in found]


def for_box(config: Config, extra: Iterable[tuple[str, str]] = ()) -> Redactor:
    """A redactor that knows this box's secret values: the configuration's secret keys (and
    their secret parts: a database URL's password, a webhook's path and query), the Hub
    token file, `server.key`, `engine-api.key` and every other file under `secrets/` (a cell
    head's member credentials), read when this user may (a file that cannot be read cannot
    leak either). `extra`: (value, label) pairs to add."""
    from urllib.parse import urlsplit

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    redactor = Redactor()
    secrets_dir = config.paths.state_dir / "secrets"
    redactor.add(_read(secrets_dir / "server.key"), "server secret")
    redactor.add(_read(secrets_dir / "engine-api.key"), "engine API key")
    redactor.add(_read(secrets_dir / "engine-api.key.previous"), "engine API key")
    for path, label in _other_secrets(secrets_dir):
        redactor.add(_read(path), label)
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
