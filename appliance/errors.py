"""Errors a person can see.

Every error that reaches an operator names its cause and the next step. The domain raises
`ApplianceError`; the delivery layer (CLI, admin API, UI, gateway) decides how to render it
(a line on stderr, problem+json, an htmx partial, an OpenAI error body). Nothing here knows
about HTTP beyond the suggested status code.
"""

from __future__ import annotations

# Exit codes from sysexits.h, which systemd units key on (RestartPreventExitStatus=78).
EX_USAGE = 64
EX_DATAERR = 65
EX_SOFTWARE = 70
EX_CANTCREAT = 73
EX_TEMPFAIL = 75
EX_CONFIG = 78


class ApplianceError(Exception):
    """An error with a stable machine code, a human message and a hint for the next step.

    `status` is the HTTP status a delivery layer should use; `exit_code` the process exit
    status a CLI should use.
    """

    status: int = 400
    exit_code: int = EX_SOFTWARE

    def __init__(
        self,
        code: str,
        message: str,
        hint: str = "",
        *,
        status: int | None = None,
        exit_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint
        if status is not None:
            self.status = status
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def as_text(self) -> str:
        """One or two lines for a terminal or the journal."""
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(ApplianceError):
    """The configuration cannot be used; the daemon exits 78 so systemd does not loop."""

    exit_code = EX_CONFIG

    def __init__(self, source: str, key: str, found: str, expected: str) -> None:
        where = f"{source}: {key}" if key else source
        super().__init__(
            "config_invalid",
            f"configuration error in {where}: found {found}, expected {expected}",
            "fix the value (see docs/configuration.md) and start the daemon again",
        )
        self.source = source
        self.key = key
        self.found = found
        self.expected = expected


class SchemaMismatch(ApplianceError):
    """The database schema is not the one this code expects."""

    exit_code = EX_CONFIG


class MigrationFailed(ApplianceError):
    """A schema migration raised; the pre-migration copy has been put back where possible."""

    exit_code = EX_SOFTWARE


class AlreadyRunning(ApplianceError):
    """Another daemon holds the state directory's lock."""

    exit_code = EX_TEMPFAIL
