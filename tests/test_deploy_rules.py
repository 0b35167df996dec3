"""The Prometheus rules in deploy/ (issue 24): the file parses as Prometheus's rule-file YAML
(groups of records and alerts, each alert with its expression, a `for`, a severity and words
that say the next step), and every appliance metric, label value and recorded series it reads
exists: the metric names against what a gateway's /metrics really exports after it has
counted a request of each result, the label values against the gateway's own result codes
and the built-in classes. A rename on either side fails here, not silently in Prometheus."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest

from appliance.gateway import slo
from appliance.gateway.classes import DEFAULT_CLASSES
from appliance.gateway.metrics import GatewayMetrics

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "slo-rules.yml"
NAME = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[|\))")
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\([^)]*\)")  # label lists, not names
MATCHER = re.compile(r'\b(class|result)\s*=\s*"([^"]*)"')


def rules() -> list[dict[str, Any]]:
    body = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert isinstance(body, dict) and set(body) == {"groups"}
    found = [rule for group in body["groups"] for rule in group["rules"]]
    assert all(isinstance(g["name"], str) and g["rules"] for g in body["groups"])
    return found


def exported() -> set[str]:
    """The sample names a gateway's /metrics carries once each SLO result was counted."""
    metrics = GatewayMetrics()
    for result in slo.RESULTS:
        metrics.slo.labels("interactive", result, "").inc()
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_rule_file_parses_and_every_alert_is_complete() -> None:
    found = rules()
    alerts = {r["alert"]: r for r in found if "alert" in r}
    assert set(alerts) == {"ApplianceInteractiveSLOAttainmentLow",
                           "ApplianceSLOEarlyRefusalsHigh"}
    for rule in alerts.values():
        assert re.fullmatch(r"\d+[smh]", rule["for"]) and rule["labels"]["severity"]
        assert "Next step" in rule["annotations"]["description"]
    low = alerts["ApplianceInteractiveSLOAttainmentLow"]["expr"]
    assert '{class="interactive"} < 0.95' in low and "[10m]" in low
    assert "> 0.10" in alerts["ApplianceSLOEarlyRefusalsHigh"]["expr"]


def test_every_metric_and_label_the_rules_read_is_exported() -> None:
    found = rules()
    recorded = {r["record"] for r in found if "record" in r}
    functions = {"sum", "rate", "increase", "by", "on"}
    names = {n for r in found for n in NAME.findall(GROUPING.sub("", r["expr"]))} - functions
    assert names, "no metric found in the rules"
    exports = exported()
    missing = {n for n in names - recorded if n not in exports}
    assert not missing, f"the rules read metrics /metrics does not export: {missing}"
    assert "appliance_gateway_slo_requests_total" in names
    for rule in found:
        for label, value in MATCHER.findall(rule["expr"]):
            allowed = set(slo.RESULTS) if label == "result" else set(DEFAULT_CLASSES)
            assert value in allowed, f"{label}={value!r} is never exported"
