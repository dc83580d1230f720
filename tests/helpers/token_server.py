"""A registry token service for the tests: Docker's token authentication,
as the CNCF distribution registry's `auth: token:` expects it.

GET /token?service=S&scope=repository:NAME:ACTIONS checks the request's Basic
credentials against the users given, and answers a JWT (RS256, its signing
certificate in the `x5c` header; the registry trusts that certificate through
its `rootcertbundle`) granting the requested actions the user may have: a
user named `pusher` may pull and push, any other only pull. A request
without credentials or with wrong ones is answered 401. Every request is
logged as one JSON line (user, whether it was granted, service, scopes) to
LOG, so a test can check what the worker asked for.

Usage: token_server.py PORT KEY_PEM CERT_PEM ISSUER LOG USER:PASSWORD...
Needs python3 and `cryptography` (Debian python3-cryptography).
"""
import base64
import http.server
import json
import sys
import time
import urllib.parse
import uuid

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def main():
    port, key_path, cert_path, issuer, log_path = sys.argv[1:6]
    users = dict(u.split(":", 1) for u in sys.argv[6:])
    with open(key_path, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    with open(cert_path, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    x5c = [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()]
    log = open(log_path, "a", buffering=1)

    def sign(claims):
        header = {"typ": "JWT", "alg": "RS256", "x5c": x5c}
        signing_input = (b64url(json.dumps(header).encode()) + "."
                         + b64url(json.dumps(claims).encode()))
        sig = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return signing_input + "." + b64url(sig)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _answer(self, status, doc, extra=()):
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in extra:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            if url.path != "/token":
                return self._answer(404, {"error": "not found"})
            query = urllib.parse.parse_qs(url.query)
            service = query.get("service", [""])[0]
            scopes = query.get("scope", [])
            user = None
            auth = self.headers.get("Authorization", "")
            if auth.lower().startswith("basic "):
                try:
                    u, p = base64.b64decode(auth[6:]).decode().split(":", 1)
                except ValueError:
                    u, p = None, None
                if u in users and users[u] == p:
                    user = u
            log.write(json.dumps({"user": user, "granted": user is not None,
                                  "service": service, "scope": scopes}) + "\n")
            if user is None:
                return self._answer(401, {"errors": [{"code": "UNAUTHORIZED"}]},
                                    [("WWW-Authenticate", 'Basic realm="iiw-token"')])
            may = {"pull", "push"} if user == "pusher" else {"pull"}
            access = []
            for scope in scopes:
                kind, _, rest = scope.partition(":")
                name, _, actions = rest.rpartition(":")
                granted = [a for a in actions.split(",") if a in may]
                if kind == "repository" and name:
                    access.append({"type": kind, "name": name, "actions": granted})
            now = int(time.time())
            token = sign({"iss": issuer, "sub": user, "aud": service,
                          "exp": now + 300, "nbf": now - 10, "iat": now,
                          "jti": uuid.uuid4().hex, "access": access})
            self._answer(200, {"token": token, "access_token": token,
                               "expires_in": 300})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
