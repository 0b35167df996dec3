"""A small OpenID provider that can be told to misbehave, run as its own process on loopback:
`python -m tests.oidc_provider PORT`. It prints "ready" once it listens.

Discovery, JWKS (one RSA key made at start), an authorize endpoint that signs the configured
user in at once (no form: the plain-HTTP tests follow the flow by hand), and a token endpoint
that checks the client secret, the code, the redirect URI and the PKCE verifier (S256) like a
real one. POST /_control with JSON sets the user's claims and `mode`, how the next ID tokens
go wrong: "ok", "tampered" (signature broken), "expired", "wrong_audience", "wrong_nonce",
"foreign_key" (signed by a key not in the JWKS).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from joserfc import jwt
from joserfc.jwk import RSAKey

CLIENT_ID = "appliance-console"
CLIENT_SECRET = "s3cret-for-tests"


class Provider:
    def __init__(self, port: int) -> None:
        self.issuer = f"http://127.0.0.1:{port}"
        self.key = RSAKey.generate_key(2048, parameters={"kid": "k1", "use": "sig"})
        self.foreign = RSAKey.generate_key(2048, parameters={"kid": "k1", "use": "sig"})
        self.codes: dict[str, dict[str, Any]] = {}
        self.mode = "ok"
        self.claims: dict[str, Any] = {"sub": "u-1", "preferred_username": "olivia",
                                       "groups": ["appliance-operators"]}
        self.lock = threading.Lock()

    def id_token(self, nonce: str) -> str:
        now = int(time.time())
        claims = {"iss": self.issuer, "aud": CLIENT_ID, "iat": now, "exp": now + 300,
                  "nonce": nonce, **self.claims}
        if self.mode == "expired":
            claims.update(iat=now - 3600, exp=now - 1800)
        elif self.mode == "wrong_audience":
            claims["aud"] = "another-client"
        elif self.mode == "wrong_nonce":
            claims["nonce"] = "not-the-one-sent"
        key = self.foreign if self.mode == "foreign_key" else self.key
        token = jwt.encode({"alg": "RS256", "kid": "k1"}, claims, key)
        if self.mode == "tampered":  # change the payload, keep the signature
            head, body, sig = token.split(".")
            data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            data["groups"] = ["appliance-admins"]
            body = base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")
            token = f"{head}.{body}.{sig}"
        return token


def handler(provider: Provider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def answer(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/.well-known/openid-configuration":
                i = provider.issuer
                self.answer(200, {"issuer": i, "authorization_endpoint": f"{i}/authorize",
                                  "token_endpoint": f"{i}/token", "jwks_uri": f"{i}/jwks",
                                  "response_types_supported": ["code"],
                                  "id_token_signing_alg_values_supported": ["RS256"]})
            elif url.path == "/jwks":
                self.answer(200, {"keys": [provider.key.as_dict(private=False)]})
            elif url.path == "/authorize":
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                if q.get("client_id") != CLIENT_ID or q.get("code_challenge_method") != "S256" \
                        or "openid" not in q.get("scope", "").split():
                    self.answer(400, {"error": "invalid_request"})
                    return
                code = secrets.token_urlsafe(16)
                with provider.lock:
                    provider.codes[code] = q
                target = q["redirect_uri"] + "?" + urlencode({"code": code, "state": q["state"]})
                self.answer(302, None, {"location": target})
            else:
                self.answer(404, {"error": "not_found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            raw = self.rfile.read(length).decode()
            if self.path == "/_control":
                body = json.loads(raw)
                with provider.lock:
                    provider.mode = body.get("mode", provider.mode)
                    provider.claims = body.get("claims", provider.claims)
                self.answer(200, {"mode": provider.mode})
                return
            if self.path != "/token":
                self.answer(404, {"error": "not_found"})
                return
            form = {k: v[0] for k, v in parse_qs(raw).items()}
            basic = self.headers.get("authorization", "")
            expected = base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
            if basic != f"Basic {expected}":
                self.answer(401, {"error": "invalid_client"})
                return
            with provider.lock:
                asked = provider.codes.pop(form.get("code", ""), None)
            verifier = form.get("code_verifier", "")
            challenge = base64.urlsafe_b64encode(
                hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
            if asked is None or asked["redirect_uri"] != form.get("redirect_uri") \
                    or asked["code_challenge"] != challenge:
                self.answer(400, {"error": "invalid_grant"})
                return
            with provider.lock:
                token = provider.id_token(asked.get("nonce", ""))
            self.answer(200, {"access_token": secrets.token_urlsafe(16), "token_type": "Bearer",
                              "expires_in": 300, "id_token": token})

    return Handler


def main() -> None:
    port = int(sys.argv[1])
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(Provider(port)))
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
