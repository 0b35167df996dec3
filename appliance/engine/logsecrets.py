"""Secrets out of the engine's log: what a line may carry that nobody outside the engine's own
files should read, and the one way to take it out.

SGLang 0.5.23 logs its resolved arguments at every start as a Python dict
(`server_args={'model_path': ..., 'api_key': 'KEY', ...}`, `srt/entrypoints/engine.py`
`_server_args_for_logging`), redacting only the watermark secrets. The engine key there opens
the engine port to anyone who reads it, past the gateway's keys, limits and usage. So every
place an engine log line leaves the engine's files (the parser's `server_args`, the log API and
its stream, the Engine page, `appliance engine parse-log`, the support bundle) passes it
through `redact` first.

What is redacted, values only (the names, the figures and the rest of the line stay):

- the value of a secret-bearing field, wherever it stands as `'name': value`, `"name": value`,
  `name=value`, `--name value` or `['--name', 'value']`: the ServerArgs fields `api_key`,
  `admin_api_key`, `ssl_keyfile_password`, `watermark_key`, `watermark_key_b`,
  `watermark_config` (`SECRET_FIELDS`), and any name that ends in password, secret, api key,
  access key, private key or secret key, or is a token's name (`token`, `hf_token`,
  `access_token` ...), such as the storage credentials a `hicache_storage_backend_extra_config`
  JSON carries;
- a URL's password (`https://user:[redacted]@host`, the user kept) or its whole user part when
  it has no password (a token as the user), and credential-named query parameters
  (`?token=`, `&sig=`, `&key=` ...);
- a bearer credential (`Bearer X`);
- any literal value the caller knows to be secret (the engine key the daemon holds), wherever
  it appears.

Invariants: pure and total (never raises); idempotent (`redact(redact(x)) == redact(x)`); a
value already redacted, `None`, `null` or empty is left as it is, so `'admin_api_key': None`
still says there is none; a quoted value keeps its quotes, so a dict repr or a JSON line stays
well formed. Words are never redacted: `#new-token: 6`, `#full token: 2048`,
`kt_max_deferred_experts_per_token=0` and `bucket_time_to_first_token=[...]` are figures, and
their names are not secret names (a name must start at a word boundary that is not `-`, `#`
or `.`, and a bare `token` followed by `:` counts only when quoted, as a key).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

MARK = "[redacted]"
# A literal shorter than this would redact ordinary words; every real key is far longer.
MIN_LITERAL = 8

# ServerArgs fields of 0.5.23 that hold a credential (srt/server_args.py, srt/arg_groups/;
# watermark_* are the ones SGLang itself hides, `<redacted>`).
SECRET_FIELDS = frozenset({
    "api_key", "admin_api_key", "ssl_keyfile_password", "watermark_key", "watermark_key_b",
    "watermark_config",
})

# A name that holds a secret whatever precedes it (`ssl_keyfile_password`, `redis-password`,
# `aws_secret_access_key`, `admin_api_key`).
_ENDS_SECRET = (
    r"(?:[A-Za-z0-9]+[_-])*(?:password|passwd|secret(?:[_-](?:access[_-])?key)?|"  # noqa: S105
    r"api[_-]?key|access[_-]key(?:[_-]id)?|private[_-]key|credentials?|watermark[_-]key"
    r"(?:[_-]b)?|watermark[_-]config)"
)
# A token's name. Only these: most names ending in "token" are figures (`per_token`).
_TOKEN_NAME = (  # names, not tokens
    r"(?:hf|hub|access|auth|api|bearer|refresh|id|session|security|github|gh|client)"  # noqa: S105
    r"[_-]token"
)
_SECRET_NAME = re.compile(rf"(?:{_ENDS_SECRET}|{_TOKEN_NAME}|token)", re.I)
_NAME = rf"(?:{_ENDS_SECRET}|{_TOKEN_NAME})"
_QUOTED = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
_BARE = r"[^\s,;&)}\]'\"]+"
_START = r"(?<![\w#.\-/])"  # not inside a word, a `#new-token`, a dotted or a path name

_KEYED = re.compile(
    # 'name': v | "name": v | name=v | name: v (a bare `token` needs quotes or `=`)
    rf"{_START}(?:(?P<q>['\"])(?:{_NAME}|token)(?P=q)\s*[:=]|{_NAME}\s*[:=]|token\s*=)\s*"
    rf"(?P<value>{_QUOTED}|{_BARE})",
    re.I,
)
_FLAG = re.compile(
    # --name v | --name=v | '--name', 'v' (an argv list's repr)
    rf"(?<![\w-])--(?:{_NAME}|token)(?:\s*=\s*|\s+|(?P<q>['\"]),\s*(?=['\"]))"
    rf"(?P<value>{_QUOTED}|(?!--){_BARE})",
    re.I,
)
_URL_USER = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]{0,30}://)(?P<user>[^\s/@'\"<>?#]+)@",
                       re.I)
_URL_QUERY = re.compile(
    rf"(?P<name>[?&;](?:{_NAME}|token|key|apikey|sig|signature|code|auth|x-amz-signature|"
    r"x-amz-credential|x-amz-security-token)=)(?P<value>[^&\s'\"#<>]+)",
    re.I,
)
_BEARER = re.compile(r"(?P<name>\bbearer\s+)(?P<value>[A-Za-z0-9._~+/=-]{8,})", re.I)
# Values that hide nothing: none given, or already redacted (by us, or SGLang's own).
_KEPT = frozenset({"none", "null", "''", '""', "", *(
    form for mark in (MARK, "<redacted>") for form in (mark, f"'{mark}'", f'"{mark}"'))})


def is_secret_name(name: str) -> bool:
    """Whether a field or key named `name` holds a credential (see the module docstring)."""
    return name in SECRET_FIELDS or _SECRET_NAME.fullmatch(name) is not None


def redact(text: str, literals: Iterable[str] = ()) -> str:
    """`text` with every secret value in it replaced by `MARK` (module docstring); `literals`
    are values known to be secret (shorter than `MIN_LITERAL` ones are ignored)."""
    for literal in sorted({v for v in literals if v and len(v) >= MIN_LITERAL}, key=len,
                          reverse=True):
        text = text.replace(literal, MARK)
    if not _may_hold_secret(text):
        return text
    text = _KEYED.sub(_value, text)
    text = _FLAG.sub(_value, text)
    text = _URL_USER.sub(_userinfo, text)
    text = _URL_QUERY.sub(_value, text)
    return _BEARER.sub(_value, text)


def redact_lines(lines: Iterable[str], literals: Iterable[str] = ()) -> list[str]:
    known = tuple(literals)
    return [redact(line, known) for line in lines]


def redact_bytes(data: bytes, literals: Iterable[str] = ()) -> bytes:
    """`redact` over raw log bytes, line by line; bytes that are not UTF-8 come back as
    they were (surrogate escapes), so nothing but secrets changes."""
    known = tuple(literals)
    text = data.decode("utf-8", errors="surrogateescape")
    lines = text.splitlines(keepends=True)
    return "".join(redact(line, known) for line in lines).encode("utf-8", "surrogateescape")


def redact_pairs(pairs: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Parsed `name -> value text` pairs with each secret field's value replaced (unless it
    says there is none), and secrets inside other values (a JSON config, a URL) redacted."""
    return tuple((name, _field_value(name, value)) for name, value in pairs)


def redact_json(value: Any, literals: Iterable[str] = ()) -> Any:
    """A JSON-ready value redacted structurally: a secret-named key's value becomes `MARK`
    (unless it says there is none), every other string is `redact`ed; the result is as valid
    JSON as the input."""
    known = tuple(literals)
    return _walk(value, known)


def _walk(value: Any, literals: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return redact(value, literals)
    if isinstance(value, Mapping):
        return {key: (MARK if isinstance(key, str) and is_secret_name(key)
                      and not _says_none(value[key]) else _walk(value[key], literals))
                for key in value}
    if isinstance(value, list | tuple):
        return [_walk(item, literals) for item in value]
    return value


def _says_none(value: Any) -> bool:
    """Whether a secret field's value hides nothing (None, empty, `'None'`, already redacted):
    kept as it is, so the field still says there is none."""
    return value is None or (isinstance(value, str) and value.strip().lower() in _KEPT)


def _field_value(name: str, value: str) -> str:
    if is_secret_name(name) and not _says_none(value):
        return MARK
    return redact(value)


def _may_hold_secret(text: str) -> bool:
    """A cheap first look: most log lines name nothing secret and skip the patterns."""
    lowered = text.lower()
    return any(word in lowered for word in (
        "key", "pass", "secret", "token", "credential", "://", "bearer", "sig", "code=",
        "auth="))


def _value(match: re.Match[str]) -> str:
    value = match.group("value")
    if value.lower() in _KEPT:
        return match.group(0)
    start, end = match.span("value")
    whole_start = match.start()
    head = match.string[whole_start:start]
    tail = match.string[end:match.end()]
    quote = value[0] if value[:1] in ("'", '"') and len(value) >= 2 else ""
    return f"{head}{quote}{MARK}{quote}{tail}"


def _userinfo(match: re.Match[str]) -> str:
    user = match.group("user")
    if user == MARK or user.endswith(f":{MARK}"):
        return match.group(0)
    name, colon, _ = user.partition(":")
    kept = f"{name}:{MARK}" if colon and name else MARK
    return f"{match.group('scheme')}{kept}@"
