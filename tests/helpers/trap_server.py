"""A listener at an address no connection of the worker may reach: it logs
every request it gets (method, path, Authorization header) as one JSON line
to LOG and answers 401 (a token realm that wanted credentials) with an
empty body, so a test can tell whether, and with what, it was reached.

Usage: trap_server.py HOST PORT LOG   (prints "ready" once it listens)
"""
import http.server
import json
import socket
import sys


def main():
    host, port, log_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    log = open(log_path, "a", buffering=1)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            log.write(json.dumps({
                "method": self.command,
                "path": self.path,
                "authorization": self.headers.get("Authorization"),
            }) + "\n")
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), Handler)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
