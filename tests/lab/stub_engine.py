"""A small OpenAI-compatible server for boot-lifecycle tests, started as a `command` engine.

It misbehaves on request: exit at once, never become ready, ignore SIGTERM, die while measured,
exit in the middle of the readiness probe, wait before it listens, hang (accept connections and
send nothing) once a file exists. Standard library only, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="stub")
    parser.add_argument("--exit", type=int, default=None, help="exit at once with this status")
    parser.add_argument("--never-ready", action="store_true", help="answer completions with 503 forever")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--die-on-stats", action="store_true",
                        help="exit when /v1/stats is asked for after the capability probe's look at it")
    parser.add_argument("--child-pid-file", help="start a sleeping child in the same group; write its pid here")
    parser.add_argument("--exit-on-completion", type=int, default=None,
                        help="exit with this status when the first completion request arrives, answering nothing")
    parser.add_argument("--listen-after", help="wait while this file exists before listening")
    parser.add_argument("--hang-file", help="once this file exists, take every request and answer nothing")
    parser.add_argument("--seqs", default="")  # a flag arms can change; echoed in /v1/models
    args = parser.parse_args()
    print(f"stub engine: argv={sys.argv[1:]} STUB_ENV={os.environ.get('STUB_ENV', '')}", flush=True)
    if args.exit is not None:
        print(f"stub engine: exiting with {args.exit} as asked", file=sys.stderr, flush=True)
        sys.exit(args.exit)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.child_pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.child_pid_file, "w") as f:
            f.write(str(child.pid))

    stats_asked: list[int] = []

    def hang_if_asked() -> None:
        if args.hang_file and os.path.exists(args.hang_file):
            print("stub engine: hanging as asked", flush=True)
            time.sleep(3600)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            hang_if_asked()
            if self.path == "/v1/stats":
                stats_asked.append(1)
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": args.model, "seqs": args.seqs}]})
            elif self.path == "/v1/stats" and args.die_on_stats and len(stats_asked) > 1:
                print("stub engine: dying on /v1/stats as asked", flush=True)
                # Hang up first and exit a moment later, as a real process tearing down does: the
                # lab sees the connection drop while the engine is still alive.
                self.connection.shutdown(socket.SHUT_RDWR)
                time.sleep(0.5)
                os._exit(3)
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            hang_if_asked()
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if args.exit_on_completion is not None and self.path == "/v1/completions":
                print(f"stub engine: exiting with {args.exit_on_completion} in the middle of a completion",
                      flush=True)
                os._exit(args.exit_on_completion)
            if args.never_ready:
                self._send(503, {"error": {"message": "still loading"}})
            elif self.path == "/v1/completions":
                self._send(200, {"id": "x", "object": "text_completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            else:
                self._send(404, {"error": {"message": "not found"}})

    while args.listen_after and os.path.exists(args.listen_after):
        time.sleep(0.05)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
