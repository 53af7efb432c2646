"""`locomm-peer status --serve`: the page and its JSON, read by a real headless Chromium beside a real swarm.

Three `join` processes train on loopback; `status --serve 0` (one DHT client) serves the page; Chromium loads it,
runs its script and dumps the DOM (checked: one row per peer, one loss curve per peer, the summary line) and takes
a screenshot (kept in the test's folder, and copied to ``$LOCOMM_TEST_ARTIFACTS`` when that is set). Chromium is
Debian's ``chromium`` (.ci/run installs it); the browser part skips where none is installed, saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_peer import join, swarm_spec

from locomm.cli.status_page import MAX_HEAD_BYTES, StatusPage
from locomm.testing.launcher import wait_until

pytestmark = pytest.mark.timeout(420)

CHROMIUM = next((c for c in ("chromium", "chromium-browser", "google-chrome") if shutil.which(c)), None)


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_status_page_in_headless_chromium_shows_every_peer_and_its_loss(tmp_path, launcher):
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    cfg = swarm_spec(tmp_path, inner_steps=10)
    a = join(launcher, "a", cfg, "--until-round", "100000", "--shard", "0/3")
    boot = a.address()
    peers = [a] + [
        join(launcher, n, cfg, "--until-round", "100000", "--shard", f"{i}/3", initial=boot)
        for i, n in ((1, "b"), (2, "c"))
    ]
    serve = subprocess.Popen(
        [sys.executable, "-m", "locomm.cli.main", "status", "--initial-peers", boot, "--serve", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        url = None
        t_end = time.monotonic() + 120
        while url is None and time.monotonic() < t_end and serve.poll() is None:
            line = serve.stderr.readline()
            if m := re.search(r"(http://127\.0\.0\.1:\d+/)", line):
                url = m.group(1)
        assert url, f"status --serve did not start (exit {serve.poll()})"

        def ready() -> bool:
            d = get_json(url + "status.json")
            hist = d["history"]
            return (
                d["snapshot"] is not None
                and len(d["snapshot"]["peers"]) == 3
                and all(sum(h["peer"] == p["peer"] for h in hist) >= 2 for p in d["snapshot"]["peers"])
                and all(p["state"] == "training" for p in d["snapshot"]["peers"])  # each answered a hello
            )

        what = "three training peers, each with two points of loss history on the page's JSON"
        wait_until(ready, 240, what, peers)
        data = get_json(url + "status.json")
        ids = {p["peer"] for p in data["snapshot"]["peers"]}
        assert data["error"] is None and len(ids) == 3

        # The browser runs the page's script (it fetches status.json and draws); the DOM it ends with is checked.
        dom = chromium("--virtual-time-budget=8000", "--dump-dom", url)
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        rows = re.findall(r'<tr class="peer">.*?</tr>', html, flags=re.S)
        assert len(rows) == 3, html[-3000:]
        assert {re.search(r'title="(\w+)"', r).group(1) for r in rows} == ids
        assert all("training" in r for r in rows)
        assert html.count('class="curve"') == 3, "one loss curve per peer"
        assert "3 peers, round" in html and f"run {data['snapshot']['run']}" in html

        shot = tmp_path / "status-page.png"
        png = chromium("--virtual-time-budget=8000", "--window-size=1000,720", f"--screenshot={shot}", url)
        assert png.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, png.stderr[-2000:]
        if out := os.environ.get("LOCOMM_TEST_ARTIFACTS"):
            Path(out).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(out) / shot.name)
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    assert serve.returncode in (0, -15), serve.returncode  # Ctrl-C/SIGTERM: a clean stop


async def test_the_status_server_answers_bad_requests_with_codes_and_keeps_serving():
    page = StatusPage(["/ip4/127.0.0.1/tcp/1"], interval_s=60)
    page.note({"run": "r", "peers": [{"peer": "QmA", "step": 3, "loss": 2.5, "round": 1}]}, 100.0)
    page.note({"run": "r", "peers": [{"peer": "QmA", "step": 3, "loss": 2.4, "round": 1}]}, 101.0)  # same step
    server = await asyncio.start_server(
        page.handle, "127.0.0.1", 0, limit=MAX_HEAD_BYTES
    )  # serve() without the refresher
    port = server.sockets[0].getsockname()[1]

    async def ask(raw: bytes) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(raw)
        await w.drain()
        out = await asyncio.wait_for(r.read(), 10)
        w.close()
        return out

    try:
        assert (await ask(b"GET /nothing HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
        assert (await ask(b"POST / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
        assert (await ask(b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")).startswith(b"HTTP/1.1 431")
        assert (await ask(b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 405")
        page_html = await ask(b"GET / HTTP/1.1\r\n\r\n")
        assert page_html.startswith(b"HTTP/1.1 200") and b"<svg" in page_html and b"status.json" in page_html
        raw = await ask(b"GET /status.json HTTP/1.1\r\n\r\n")
        body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        assert [h["loss"] for h in body["history"]] == [2.5]  # one point per step moved
        assert body["snapshot"]["run"] == "r"
    finally:
        server.close()
        await server.wait_closed()
