"""Cross-origin requests as vLLM allows them (`--allowed-origins` and its siblings, Starlette's
CORSMiddleware): a real headless Chromium loads a page served from another origin whose script
streams a chat completion with `fetch` and writes it into the page, and the text it got is the
server's own greedy answer; an origin not in the list gets no Access-Control-Allow-Origin, and
the browser refuses the page the call."""

from __future__ import annotations

import http.server
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.engine.server_process import engine_server

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
        "temperature": 0}

# The page streams the chat completion with fetch, writes the text into <pre id="out">, and posts
# what the page then shows back to its own origin, where the test reads it.
PAGE = """<!doctype html>
<html><head><title>cors</title></head><body><pre id="out"></pre><script>
(async () => {
  const out = document.getElementById('out');
  try {
    const r = await fetch(%(engine)s + '/v1/chat/completions', {method: 'POST',
      headers: {'Content-Type': 'application/json'}, body: JSON.stringify(%(body)s)});
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf('\\n\\n')) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (event.startsWith('data: ') && event !== 'data: [DONE]') {
          for (const choice of JSON.parse(event.slice(6)).choices) out.textContent += choice.delta.content || '';
        }
      }
    }
  } catch (error) {
    out.textContent = 'FETCH FAILED: ' + error;
  }
  await fetch('/result', {method: 'POST', body: out.textContent});
})();
</script></body></html>
"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class PageServer:
    """A tiny HTTP server on its own port (so its own origin): GET / is the page, POST /result
    is what the page reports."""

    def __init__(self) -> None:
        self.results: queue.Queue[str] = queue.Queue()
        self.page = b""
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/html; charset=utf-8")
                self.send_header("content-length", str(len(owner.page)))
                self.end_headers()
                self.wfile.write(owner.page)

            def do_POST(self) -> None:
                owner.results.put(self.rfile.read(int(self.headers["content-length"])).decode())
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def page_servers(count: int) -> Iterator[list[PageServer]]:
    servers = [PageServer() for _ in range(count)]
    try:
        yield servers
    finally:
        for s in servers:
            s.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The engine allows the first page server's origin only."""
    with page_servers(2) as (allowed, other):
        with engine_server(tmp_path_factory.mktemp("cors"), "--max-model-len", "512",
                           "--allowed-origins", json.dumps([allowed.origin]),
                           "--allowed-headers", json.dumps(["content-type", "authorization"])) as server:
            for page in (allowed, other):
                page.page = (PAGE % {"engine": json.dumps(server.url), "body": json.dumps({**CHAT, "stream": True})}
                             ).encode()
            yield server, allowed, other


def browse(page: PageServer, profile: Path, timeout: float = 180) -> str:
    """What the page reports after headless Chromium loads it."""
    binary = chromium()
    proc = subprocess.Popen([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                             "--no-first-run", f"--user-data-dir={profile}", page.origin + "/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return page.results.get(timeout=timeout)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_preflight_is_answered_for_an_allowed_origin(setup) -> None:
    server, allowed, _ = setup
    r = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": allowed.origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == allowed.origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "content-type" in r.headers["access-control-allow-headers"].lower()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"Origin": allowed.origin}, timeout=120)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed.origin


def test_a_disallowed_origin_gets_no_allow_origin(setup) -> None:
    server, _, other = setup
    r = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": other.origin, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": other.origin})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.skipif(chromium() is None, reason="headless Chromium not found (Debian's `chromium` package; "
                                               "`make test` installs it where apt-get can run as root)")
def test_a_page_from_another_origin_streams_a_chat_completion_in_a_browser(setup, tmp_path) -> None:
    server, allowed, other = setup
    expected = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=120).json()
    text = expected["choices"][0]["message"]["content"]
    assert text
    assert browse(allowed, tmp_path / "allowed") == text
    # The same page from an origin the server does not list: the browser refuses the script the answer.
    assert browse(other, tmp_path / "other").startswith("FETCH FAILED: TypeError")


def test_cors_flags_take_json_lists(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "lab.engine", "serve", "--allowed-origins", "https://a.example"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--allowed-origins" in r.stderr and "JSON list" in r.stderr
