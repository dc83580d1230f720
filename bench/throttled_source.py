#!/usr/bin/env python3
"""An image source for bench/run peers: serves the files of a directory
(GET/HEAD, Content-Length, Last-Modified) to all its clients together at no
more than RATE bytes per second (one token bucket shared by every
connection), and counts the body bytes it sent: GET /_stats answers them.

Usage: throttled_source.py DIR PORT RATE
"""
import asyncio
import email.utils
import os
import sys

DIR, PORT, RATE = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
CHUNK = 256 * 1024
sent = 0


class Bucket:
    """Tokens (bytes) refilled at RATE per second, shared by all clients."""

    def __init__(self, rate):
        self.rate, self.tokens = rate, 0.0
        self.last = asyncio.get_event_loop().time()
        self.lock = asyncio.Lock()

    async def take(self, n):
        async with self.lock:
            while True:
                now = asyncio.get_event_loop().time()
                self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
                self.last = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                await asyncio.sleep((n - self.tokens) / self.rate)


async def handle(reader, writer, bucket):
    global sent
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path = head.decode("latin-1").split()[:2]
        if path == "/_stats":
            body = str(sent).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            return
        file = os.path.join(DIR, os.path.basename(path))
        if not os.path.isfile(file):
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        st = os.stat(file)
        modified = email.utils.formatdate(st.st_mtime, usegmt=True)
        writer.write(
            f"HTTP/1.1 200 OK\r\nContent-Length: {st.st_size}\r\nLast-Modified: {modified}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        if method == "HEAD":
            return
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                await bucket.take(len(chunk))
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def main():
    bucket = Bucket(RATE)
    server = await asyncio.start_server(lambda r, w: handle(r, w, bucket), "127.0.0.1", PORT)
    async with server:
        await server.serve_forever()


asyncio.run(main())
