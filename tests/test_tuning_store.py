"""Custom profiles and the applied choice in a real, migrated database."""

from __future__ import annotations

import datetime as dt

import pytest

from appliance.db.database import Database
from appliance.tuning.profiles import BUILTIN, LengthDistribution, ProfileError
from appliance.tuning.store import (
    create_profile,
    delete_profile,
    find_profile,
    get_choice,
    list_custom,
    list_profiles,
    record_spec_hash,
    set_choice,
    update_profile,
)

T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(hours=1)
LENGTHS = LengthDistribution.of([(50, 3_000), (99, 40_000), (100, 64_000)], minimum=100)


def _create(db: Database, name: str = "support-bots", **kw: object) -> None:
    fields: dict[str, object] = {"title": "Support bots", "description": "RAG answers",
                                 "lengths": LENGTHS, "target_concurrency": 40, **kw}
    db.call(lambda s: create_profile(s, name=name, at=T0, by="alice", **fields))  # type: ignore[arg-type]


def test_create_list_find_update_delete(db: Database) -> None:
    _create(db)
    stored = db.call(list_custom)
    assert len(stored) == 1
    record = stored[0]
    assert record.profile.lengths == LENGTHS and record.profile.target_concurrency == 40
    assert (record.created_by, record.created_at.tzinfo) == ("alice", dt.UTC)
    names = [p.name for p in db.call(list_profiles)]
    assert names == [*(p.name for p in BUILTIN), "support-bots"]

    longer = LENGTHS.scaled(2)
    updated = db.call(lambda s: update_profile(s, "support-bots", at=T1, by="bob",
                                               lengths=longer, target_concurrency=20))
    assert updated.profile.lengths == longer and updated.profile.title == "Support bots"
    assert (updated.updated_at, updated.updated_by, updated.created_by) == (T1, "bob", "alice")
    assert db.call(lambda s: find_profile(s, "support-bots")).target_concurrency == 20

    db.call(lambda s: delete_profile(s, "support-bots"))
    assert db.call(list_custom) == []
    with pytest.raises(ProfileError) as caught:
        db.call(lambda s: find_profile(s, "support-bots"))
    assert caught.value.code == "profile_not_found" and caught.value.status == 404


def test_builtins_need_no_database_and_cannot_be_changed(db: Database) -> None:
    assert find_profile(None, "chat") is BUILTIN[1]
    with pytest.raises(ProfileError) as caught:
        find_profile(None, "support-bots")
    assert caught.value.code == "profile_not_found"
    for action in (
        lambda s: update_profile(s, "chat", at=T0, by="x", target_concurrency=3),
        lambda s: delete_profile(s, "chat"),
        lambda s: create_profile(s, name="chat", title="Mine", description="",
                                 lengths=LENGTHS, target_concurrency=3, at=T0, by="x"),
    ):
        with pytest.raises(ProfileError) as caught:
            db.call(action)
        assert caught.value.code == "profile_builtin" and caught.value.field == "name"
        assert "built-in" in caught.value.message and caught.value.hint


def test_validation_names_the_field(db: Database) -> None:
    with pytest.raises(ProfileError) as caught:
        _create(db, name="Bad Name")
    assert caught.value.field == "name"
    with pytest.raises(ProfileError) as caught:
        _create(db, target_concurrency=0)
    assert caught.value.field == "target_concurrency"
    _create(db)
    with pytest.raises(ProfileError) as caught:
        _create(db)
    assert caught.value.code == "profile_exists"
    with pytest.raises(ProfileError) as caught:
        db.call(lambda s: update_profile(s, "support-bots", at=T1, by="x", title=""))
    assert caught.value.field == "title"
    with pytest.raises(ProfileError):
        db.call(lambda s: update_profile(s, "nobody", at=T1, by="x", title="x"))
    assert db.call(list_custom)[0].profile.title == "Support bots"  # nothing half-written


def test_choice_round_trip(db: Database) -> None:
    assert db.call(get_choice) is None
    first = db.call(lambda s: set_choice(s, profile="chat", ratio=4.0, pin=None, at=T0,
                                         by="alice"))
    assert db.call(get_choice) == first
    _create(db)
    db.call(lambda s: set_choice(s, profile="support-bots", ratio=0.45, pin=120, at=T1,
                                 by="bob"))
    db.call(lambda s: record_spec_hash(s, "ab" * 32))
    choice = db.call(get_choice)
    assert choice is not None
    assert (choice.profile, choice.ratio, choice.pin, choice.applied_by, choice.spec_hash) == (
        "support-bots", 0.45, 120, "bob", "ab" * 32)
    assert choice.applied_at == T1 and choice.to_dict()["pin"] == 120
    # The applied profile cannot be deleted from under the running split.
    with pytest.raises(ProfileError) as caught:
        db.call(lambda s: delete_profile(s, "support-bots"))
    assert caught.value.code == "profile_in_use"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"profile": "nobody"}, "name"),
    ({"ratio": 0.0}, "ratio"),
    ({"ratio": float("inf")}, "ratio"),
    ({"pin": 0}, "pin"),
])
def test_choice_validation(db: Database, kwargs: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"profile": "chat", "ratio": 1.0, "pin": None, **kwargs}
    with pytest.raises(ProfileError) as caught:
        db.call(lambda s: set_choice(s, at=T0, by="x", **values))  # type: ignore[arg-type]
    assert caught.value.field == field
    assert db.call(get_choice) is None


def test_spec_hash_needs_a_choice(db: Database) -> None:
    with pytest.raises(ProfileError) as caught:
        db.call(lambda s: record_spec_hash(s, "x"))
    assert caught.value.code == "choice_missing"
