"""`appliance cell rolling-restart` without a role (issue 23: the role defaulted to prefill,
which a 1 prefill + 2 decode cell always refuses): the one role with two READY engines, or a
clear refusal with the counts when neither or both qualify."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.cell.cli import rollable_role
from appliance.errors import EX_USAGE, ApplianceError
from tests.conftest import run_cli


def cell(head: tuple[str, str], *members: tuple[str, str | None]) -> dict[str, Any]:
    """The head's cell status as the CLI reads it: (role, engine state) of each box; a
    member state None did not answer."""
    return {"head": {"role": head[0], "engine_state": head[1]},
            "members": [{"role": role, "status": "ok" if state else "unreachable",
                         "engine": {"state": state}} for role, state in members]}


def test_one_prefill_two_decodes_rolls_the_decodes() -> None:
    assert rollable_role(cell(("prefill", "ready"), ("decode", "ready"),
                              ("decode", "ready"))) == "decode"


def test_two_prefills_one_decode_rolls_the_prefills() -> None:
    assert rollable_role(cell(("prefill", "ready"), ("prefill", "ready"),
                              ("decode", "ready"))) == "prefill"


def test_no_role_with_two_ready_engines_is_refused_with_the_counts() -> None:
    with pytest.raises(ApplianceError) as refused:
        rollable_role(cell(("prefill", "ready"), ("decode", "ready"), ("decode", None)))
    assert "prefill 1 ready, decode 1 ready" in refused.value.message
    assert "cell engine" in refused.value.hint and refused.value.exit_code == EX_USAGE


def test_both_roles_rollable_asks_which() -> None:
    with pytest.raises(ApplianceError) as refused:
        rollable_role(cell(("prefill", "ready"), ("prefill", "ready"), ("decode", "ready"),
                           ("decode", "ready")))
    assert "say which" in refused.value.message
    assert "rolling-restart prefill" in refused.value.hint


def test_the_cli_takes_no_role_and_names_the_default_in_its_help() -> None:
    result = run_cli("cell", "rolling-restart", "--help")
    assert result.returncode == 0, result.stderr
    assert "[{prefill,decode}]" in result.stdout  # optional, no fixed default
    assert "two ready engines" in " ".join(result.stdout.split())


def test_the_console_form_offers_the_role_that_can_be_rolled_first() -> None:
    # The Cell page's form preselected prefill, always refused in 1P+2D.
    from types import SimpleNamespace
    from typing import cast

    from appliance.cell.overview import Overview
    from appliance.ui.cell import rolling_choices

    def overview(head: str, *members: str) -> Overview:
        cards = [SimpleNamespace(member=SimpleNamespace(role=role, state="ready"))
                 for role in members]
        return cast(Overview, SimpleNamespace(
            members=cards, head=SimpleNamespace(role=head, state="ready")))

    assert rolling_choices(overview("prefill", "decode", "decode")) == ("decode", "prefill")
    assert rolling_choices(overview("prefill", "prefill", "decode")) == ("prefill", "decode")
