"""Tuning rows in the database, as frozen records (ORM rows never leave this module).

Custom profiles live in `tuning_profiles`; the built-ins are code (`profiles.BUILTIN`) and share
their name space, so a custom profile can never shadow one, and a built-in can be neither
edited nor deleted. The applied choice (one row in `tuning_choice`) is what the engine's launch
spec uses: the profile it came from, the ratio, an optional `--max-mamba-cache-size` pin, and
the spec it produced once the integrator records it.

Every function takes the caller's `Session` (one transaction) and validates with the same rules
as `profiles.make_profile`, so each refusal is a `ProfileError` naming its field.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.db.models import TuningChoice, TuningProfile
from appliance.tuning.profiles import (
    BUILTIN,
    BUILTIN_NAMES,
    LengthDistribution,
    Profile,
    ProfileError,
    builtin_profile,
    make_profile,
    validate_name,
)

_UNSET: Any = object()


@dataclass(frozen=True)
class StoredProfile:
    """A custom profile and who wrote it when."""

    profile: Profile
    created_at: dt.datetime
    created_by: str
    updated_at: dt.datetime
    updated_by: str


@dataclass(frozen=True)
class Choice:
    """The applied split: `ratio` always (SGLang needs one), `pin` when the state pool is pinned
    to exactly that many slots with `--max-mamba-cache-size` (the ratio is then ignored)."""

    profile: str
    ratio: float
    pin: int | None
    applied_at: dt.datetime
    applied_by: str
    spec_hash: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "ratio": self.ratio, "pin": self.pin,
                "applied_at": self.applied_at.isoformat(), "applied_by": self.applied_by,
                "spec_hash": self.spec_hash}


def _stored(row: TuningProfile) -> StoredProfile:
    lengths = LengthDistribution.from_json(row.lengths_json)
    profile = Profile(row.name, row.title, row.description, lengths, row.target_concurrency,
                      builtin=False)
    return StoredProfile(profile, row.created_at, row.created_by, row.updated_at, row.updated_by)


def _row(session: Session, name: str) -> TuningProfile | None:
    return session.scalars(select(TuningProfile).where(TuningProfile.name == name)).one_or_none()


def _refuse_builtin(name: str, action: str) -> None:
    if name in BUILTIN_NAMES:
        raise ProfileError("name", f"{name!r} is a built-in profile and cannot be {action}",
                           "create a custom profile with another name (start from this one's "
                           "numbers) and edit that", code="profile_builtin", status=409)


def _not_found(name: str) -> ProfileError:
    known = ", ".join(sorted(BUILTIN_NAMES))
    return ProfileError("name", f"there is no profile named {name!r}",
                        f"see `appliance tune profiles`; built-ins are {known}",
                        code="profile_not_found", status=404)


def list_custom(session: Session) -> list[StoredProfile]:
    rows = session.scalars(select(TuningProfile).order_by(TuningProfile.name))
    return [_stored(row) for row in rows]


def list_profiles(session: Session) -> list[Profile]:
    """The built-ins in their fixed order, then the custom profiles by name."""
    return [*BUILTIN, *(stored.profile for stored in list_custom(session))]


def find_profile(session: Session | None, name: str) -> Profile:
    """A built-in (no database needed: `session` may be None) or a custom profile."""
    found = builtin_profile(name)
    if found is not None:
        return found
    row = _row(session, name) if session is not None else None
    if row is None:
        raise _not_found(name)
    return _stored(row).profile


def create_profile(session: Session, *, name: str, title: str, description: str,
                   lengths: LengthDistribution, target_concurrency: int,
                   at: dt.datetime, by: str) -> StoredProfile:
    """Store a new custom profile; the name must be a free slug (not a built-in's)."""
    validate_name(name)
    _refuse_builtin(name, "created again")
    profile = make_profile(name, title, description, lengths, target_concurrency)
    if _row(session, name) is not None:
        raise ProfileError("name", f"a profile named {name!r} exists already",
                           "choose another name, or edit that profile",
                           code="profile_exists", status=409)
    row = TuningProfile(name=profile.name, title=profile.title,
                        description=profile.description, lengths_json=lengths.to_json(),
                        target_concurrency=profile.target_concurrency, created_at=at,
                        created_by=by[:128], updated_at=at, updated_by=by[:128])
    session.add(row)
    session.flush()
    return _stored(row)


def update_profile(session: Session, name: str, *, at: dt.datetime, by: str,
                   title: Any = _UNSET, description: Any = _UNSET, lengths: Any = _UNSET,
                   target_concurrency: Any = _UNSET) -> StoredProfile:
    """Change the given fields of a custom profile (the name is its identity and stays)."""
    _refuse_builtin(name, "edited")
    row = _row(session, name)
    if row is None:
        raise _not_found(name)
    current = _stored(row).profile
    profile = make_profile(
        name,
        current.title if title is _UNSET else title,
        current.description if description is _UNSET else description,
        current.lengths if lengths is _UNSET else lengths,
        current.target_concurrency if target_concurrency is _UNSET else target_concurrency,
    )
    row.title = profile.title
    row.description = profile.description
    row.lengths_json = profile.lengths.to_json()
    row.target_concurrency = profile.target_concurrency
    row.updated_at = at
    row.updated_by = by[:128]
    session.flush()
    return _stored(row)


def delete_profile(session: Session, name: str) -> None:
    """Delete a custom profile; the one the applied choice names is kept until another is
    applied, so the running split always traces back to a profile."""
    _refuse_builtin(name, "deleted")
    row = _row(session, name)
    if row is None:
        raise _not_found(name)
    choice = get_choice(session)
    if choice is not None and choice.profile == name:
        raise ProfileError("name", f"{name!r} is the profile of the applied memory split",
                           "apply another profile first, then delete this one",
                           code="profile_in_use", status=409)
    session.delete(row)


def get_choice(session: Session) -> Choice | None:
    """The applied split, or None when the operator never applied one (engine defaults)."""
    row = session.get(TuningChoice, 1)
    if row is None:
        return None
    return Choice(row.profile, row.ratio, row.pin, row.applied_at, row.applied_by, row.spec_hash)


def set_choice(session: Session, *, profile: str, ratio: float, pin: int | None,
               at: dt.datetime, by: str, spec_hash: str | None = None) -> Choice:
    """Record the applied split. The profile must exist (built-in or custom); `ratio` must be
    a positive finite number; `pin`, if given, a positive slot count."""
    find_profile(session, profile)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not (
            math.isfinite(ratio) and ratio > 0):
        raise ProfileError("ratio", f"{ratio!r} is not a positive number",
                           "give --mamba-full-memory-ratio as a number above 0, e.g. 0.9")
    if pin is not None and (isinstance(pin, bool) or not isinstance(pin, int) or pin < 1):
        raise ProfileError("pin", f"{pin!r} is not a positive slot count",
                           "give --max-mamba-cache-size as whole state slots, or no pin")
    row = session.get(TuningChoice, 1)
    if row is None:
        row = TuningChoice(id=1)
        session.add(row)
    row.profile = profile
    row.ratio = float(ratio)
    row.pin = pin
    row.applied_at = at
    row.applied_by = by[:128]
    row.spec_hash = spec_hash
    session.flush()
    return Choice(profile, float(ratio), pin, at, by[:128], spec_hash)


def record_spec_hash(session: Session, spec_hash: str) -> None:
    """Attach the launch spec the choice produced (the integrator calls this once written)."""
    row = session.get(TuningChoice, 1)
    if row is None:
        raise ProfileError("choice", "no memory split has been applied",
                           "apply a profile first, then record the spec it produced",
                           code="choice_missing", status=409)
    row.spec_hash = spec_hash
