"""The head's HTTP client to a member's admin API: the join exchange and the peer calls.

Every call has a short timeout (`TIMEOUT`: a member that does not answer is reported
unreachable, never waited on) and is audited on the head (`cell.call`: the member, method,
path, HTTP status or the failure, never a token or credential); the member audits each call
it serves. The one exception is the head's periodic status read (appliance.cell.watch): it
passes `audit_if`, which audits its outcome (ok, failed, denied) only when it changes.

TLS is verified unless the member was added with `verify_tls=false` (a box with a
self-signed certificate). Answers are turned into errors that name the cause and the next
step: unreachable, credential revoked by the member, join token refused, anything else.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import httpx

from appliance.cell.membership import Member
from appliance.errors import ApplianceError

TIMEOUT: Final = httpx.Timeout(5.0, connect=3.0)
Auditor = Callable[..., Awaitable[None]]
# Given a call's audit outcome (ok, failed, denied), whether to write its audit entry.
AuditIf = Callable[[str], bool]


class MemberUnreachable(ApplianceError):
    status = 502

    def __init__(self, address: str, why: str) -> None:
        super().__init__(
            "member_unreachable", f"the member at {address} did not answer: {why}",
            f"check that its daemon runs and that this box reaches it: curl {address}/healthz")


class MemberRevoked(ApplianceError):
    status = 409

    def __init__(self, address: str) -> None:
        super().__init__(
            "member_revoked", f"the member at {address} revoked this head's credential",
            "it left the cell (or an admin there revoked the credential): remove it here with "
            "`appliance cell remove ID`, then add it again with a new join token from it")


class MemberRefused(ApplianceError):
    status = 502

    def __init__(self, address: str, status: int, detail: str, code: str = "member_refused",
                 hint: str = "") -> None:
        super().__init__(code, f"the member at {address} refused: {detail} (HTTP {status})",
                         hint or "see the member's audit log for the call")
        self.member_status = status


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])[:300]
    return str(body)[:200]


class PeerClient:
    """Calls members on behalf of `actor` (who asked on the head, from `address`); each call
    is passed to `audit` (appliance.auditing.audit bound to the head's runtime)."""

    def __init__(self, audit: Auditor, *, actor: str, address: str,
                 transport: httpx.AsyncBaseTransport | None = None,
                 timeout: httpx.Timeout = TIMEOUT) -> None:
        self._audit = audit
        self._actor = actor
        self._address = address
        self._transport = transport
        self._timeout = timeout

    async def join(self, member_address: str, token: str, *, verify_tls: bool,
                   head_name: str) -> dict[str, Any]:
        """Exchange a join token for a peer credential; the member's answer (with
        `credential` and `prefix`)."""
        response = await self._send("POST", member_address, "/api/v1/cell/join", verify_tls,
                                    json={"token": token, "head": head_name})
        if response.status_code == 403:
            raise MemberRefused(
                member_address, 403, _detail(response), code="join_refused",
                hint="create a new join token on the member (`appliance cell join-token`) and "
                     "add it within the hour")
        body = self._body(member_address, response)
        if not str(body.get("credential", "")).startswith("acp_"):
            raise MemberRefused(member_address, response.status_code,
                                "its answer carries no peer credential",
                                hint="is that address an appliance of this release?")
        return body

    async def call(self, member: Member, credential: str, method: str, path: str,
                   json: dict[str, Any] | None = None, *,
                   audit_if: AuditIf | None = None) -> dict[str, Any]:
        """One peer call; the member's JSON answer, or an error naming the cause. Audited,
        or only when `audit_if` says so (a periodic read)."""
        response = await self._send(method, member.address, path, member.verify_tls,
                                    json=json, credential=credential,
                                    prefix=member.credential_prefix, audit_if=audit_if)
        if response.status_code == 401:
            raise MemberRevoked(member.address)
        return self._body(member.address, response)

    def _body(self, address: str, response: httpx.Response) -> dict[str, Any]:
        if response.status_code >= 400:
            raise MemberRefused(address, response.status_code, _detail(response))
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise MemberRefused(address, response.status_code, "its answer is not a JSON object",
                                hint="is that address an appliance of this release?")
        return body

    async def _send(self, method: str, base: str, path: str, verify_tls: bool, *,
                    json: dict[str, Any] | None = None, credential: str = "",
                    prefix: str = "", audit_if: AuditIf | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {credential}"} if credential else {}
        detail: dict[str, Any] = {"method": method, "path": path}
        if prefix:
            detail["credential"] = prefix
        try:
            async with httpx.AsyncClient(base_url=base, timeout=self._timeout, verify=verify_tls,
                                         transport=self._transport, trust_env=False,
                                         follow_redirects=False) as client:
                response = await client.request(method, path, json=json, headers=headers)
        except httpx.TimeoutException:
            await self._record(base, "failed", {**detail, "error": "timed out"}, audit_if)
            raise MemberUnreachable(base, "no answer within the time allowed") from None
        except httpx.HTTPError as exc:
            why = str(exc) or type(exc).__name__
            await self._record(base, "failed", {**detail, "error": why[:200]}, audit_if)
            raise MemberUnreachable(base, why[:200]) from None
        outcome = ("ok" if response.status_code < 400 else
                   "denied" if response.status_code in (401, 403) else "failed")
        await self._record(base, outcome, {**detail, "status": response.status_code}, audit_if)
        return response

    async def _record(self, member: str, outcome: str, detail: dict[str, Any],
                      audit_if: AuditIf | None = None) -> None:
        if audit_if is not None and not audit_if(outcome):
            return
        await self._audit(actor=self._actor, address=self._address, action="cell.call",
                          outcome=outcome, target=member, detail=detail)
