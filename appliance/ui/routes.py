"""Every console route, in one list for `create_app`."""

from __future__ import annotations

from litestar.handlers import BaseRouteHandler

from appliance.ui.cell import (
    cell_member_engine_ui,
    cell_member_role_ui,
    cell_notice_clear,
    cell_page,
    cell_rolling_cancel_ui,
    cell_rolling_ui,
    cell_status_partial,
)
from appliance.ui.engine import (
    engine_action_ui,
    engine_page,
    engine_schedule_cancel_ui,
    engine_schedule_partial,
    engine_schedule_ui,
    engine_status_partial,
)
from appliance.ui.health import (
    health_check_ui,
    health_mute_ui,
    health_ui,
    health_unmute_ui,
)
from appliance.ui.keys import (
    keys_create_ui,
    keys_limits_form,
    keys_limits_ui,
    keys_page,
    keys_revoke_ui,
    keys_row_ui,
)
from appliance.ui.login import change_password, login, login_page, logout, password_page
from appliance.ui.pages import (
    audit_page,
    create_token_ui,
    dashboard,
    events_page,
    revoke_token_ui,
    settings_page,
    support_bundle_ui,
)
from appliance.ui.qualify import (
    qualify_cancel_ui,
    qualify_page,
    qualify_record_page,
    qualify_run_ui,
    qualify_status_partial,
)
from appliance.ui.sso import sso_callback, sso_start
from appliance.ui.tuning import (
    tuning_apply_ui,
    tuning_editor,
    tuning_page,
    tuning_panel,
    tuning_profile_create_ui,
    tuning_profile_delete_form,
    tuning_profile_delete_ui,
    tuning_profile_update_form,
    tuning_profile_update_ui,
)
from appliance.ui.usage import usage_page
from appliance.ui.weights import (
    weights_cancel_ui,
    weights_import_ui,
    weights_page,
    weights_pull_ui,
    weights_refetch_ui,
    weights_status_partial,
    weights_verify_full_ui,
    weights_verify_quick_ui,
)


def ui_handlers() -> list[BaseRouteHandler]:
    return [
        login_page, login, logout, password_page, change_password, sso_start, sso_callback,
        dashboard, audit_page, events_page, settings_page, create_token_ui, revoke_token_ui,
        support_bundle_ui,
        engine_page, engine_status_partial, engine_action_ui, engine_schedule_partial,
        engine_schedule_ui, engine_schedule_cancel_ui,
        weights_page, weights_status_partial, weights_pull_ui, weights_verify_quick_ui,
        weights_verify_full_ui, weights_refetch_ui, weights_import_ui, weights_cancel_ui,
        tuning_page, tuning_panel, tuning_editor, tuning_apply_ui, tuning_profile_create_ui,
        tuning_profile_update_ui, tuning_profile_update_form, tuning_profile_delete_ui,
        tuning_profile_delete_form,
        usage_page,
        qualify_page, qualify_status_partial, qualify_record_page, qualify_run_ui,
        qualify_cancel_ui,
        health_ui, health_check_ui, health_mute_ui, health_unmute_ui,
        keys_page, keys_create_ui, keys_revoke_ui, keys_row_ui, keys_limits_form,
        keys_limits_ui,
        cell_page, cell_status_partial, cell_notice_clear, cell_member_engine_ui,
        cell_member_role_ui, cell_rolling_ui, cell_rolling_cancel_ui,
    ]
