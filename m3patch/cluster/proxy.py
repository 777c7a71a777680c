"""The P/D proxy: `python -m m3patch.cluster.proxy --port P --prefill URL... --decode URL...`.

vLLM's wheel ships no disaggregation proxy. This one is the smallest that is correct for a KV
connector whose transfer is keyed by the prompt (ExampleConnector's shared storage; a push
connector such as MoRIIO/NIXL needs its own handshake and vLLM's example proxy instead):
1. the request goes to a prefill instance with `max_tokens: 1` (and no streaming), which
   computes the prompt's KV and saves it through the connector;
2. the original request goes to a decode instance, which loads that KV and generates.
The decode reply is returned unchanged. Instances are chosen round-robin. `/health` answers 200
only when every instance does; `/v1/models` is the first decode instance's. Streaming requests
are refused (400): the tests and the sweep client use whole replies. Standard library only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 5.0


class Backends:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.prefill, self.decode = prefill, decode
        self._next_prefill = itertools.cycle(prefill)
        self._next_decode = itertools.cycle(decode)
        self._lock = threading.Lock()

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._next_prefill), next(self._next_decode)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: the same prompt, one token, no streaming (pure)."""
    out = {**body, "max_tokens": 1, "stream": False}
    out.pop("max_completion_tokens", None)
    out.pop("stream_options", None)
    return out


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return 503, b""


def make_handler(backends: Backends) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            print(f"m3patch[proxy]: {self.address_string()} {fmt % args}", flush=True)

        def _reply(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                ok = all(_get(f"{url}/health")[0] == 200
                         for url in (*backends.prefill, *backends.decode))
                self._reply(200 if ok else 503, b"{}")
            elif self.path == "/v1/models":
                self._reply(*_get(f"{backends.decode[0]}/v1/models"))
            else:
                self._reply(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                self._reply(400, b'{"error": "body is not JSON"}')
                return
            if self.path not in COMPLETION_PATHS or not isinstance(body, dict):
                self._reply(404, b'{"error": "not found"}')
                return
            if body.get("stream"):
                self._reply(400, b'{"error": "m3patch proxy: streaming is not supported"}')
                return
            prefill, decode = backends.pick()
            status, data = _post(prefill + self.path, prefill_body(body))
            if status != 200:
                self._reply(status, data)
                return
            print(f"m3patch[proxy]: prefill {prefill} -> decode {decode}", flush=True)
            self._reply(*_post(decode + self.path, body))

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", action="append", required=True, help="prefill base URL")
    parser.add_argument("--decode", action="append", required=True, help="decode base URL")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(Backends(args.prefill, args.decode)))
    print(f"m3patch[proxy]: listening on {args.host}:{args.port}; prefill {args.prefill}, "
          f"decode {args.decode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
