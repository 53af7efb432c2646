"""`locomm-peer status --serve PORT`: the swarm as a web page, from one DHT client kept open.

A refresher reads the swarm's records every ``interval_s`` (:class:`locomm.cli.status.SwarmReader`, reopened only
after a failure) and keeps the last snapshot and a bounded history of each peer's loss. A small HTTP/1.1 server
(asyncio streams, GET only, request head capped) serves:

- ``/``: one self-contained page (no external script, style or font) that polls ``/status.json`` every two
  seconds and draws the peers table, the swarm's round and each peer's loss over time (inline SVG);
- ``/status.json``: ``{"snapshot": ..., "history": [...], "updated": unix time, "error": str | null}``.

It binds 127.0.0.1 unless told otherwise (``--serve-host``): the page shows peer ids and traffic, nothing
secret, but a volunteer decides who sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from locomm.cli.status import read_forever

log = logging.getLogger(__name__)

HISTORY = 5000
"""Points of loss history kept (per peer and refresh: one point when the peer's step moved)."""
MAX_HEAD_BYTES = 8192
"""A request head longer than this is refused (431), as is one not complete within HEAD_TIMEOUT_S."""
HEAD_TIMEOUT_S = 10.0


class StatusPage:
    """The latest snapshot and the loss history of one swarm, refreshed in the background."""

    def __init__(self, initial_peers: list[str], swarm_key: Path | None = None, interval_s: float = 2.0) -> None:
        self.initial_peers, self.swarm_key, self.interval_s = initial_peers, swarm_key, interval_s
        self.snapshot: dict[str, Any] | None = None
        self.error: str | None = "no read yet"
        self.updated: float | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._last_step: dict[str, int] = {}

    def note(self, snap: dict[str, Any], now: float) -> None:
        """Take one read: the snapshot, and a history point for every peer whose step moved."""
        if "error" in snap:
            self.error = str(snap["error"])
            return
        self.snapshot, self.error, self.updated = snap, None, now
        for p in snap.get("peers", []):
            step = p.get("step")
            if p.get("loss") is None or step is None or self._last_step.get(p["peer"]) == step:
                continue
            self._last_step[p["peer"]] = step
            self.history.append(
                {
                    "t": now,
                    "peer": p["peer"],
                    "step": step,
                    "round": p.get("round"),
                    "loss": p["loss"],
                    "val_loss": p.get("val_loss"),
                }
            )

    def as_json(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot, "history": list(self.history), "updated": self.updated, "error": self.error}

    async def refresh_forever(self) -> None:
        snaps = read_forever(self.initial_peers, self.swarm_key, self.interval_s)
        try:
            async for snap in snaps:
                self.note(snap, time.time())
        finally:
            await snaps.aclose()

    # -- HTTP ------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except asyncio.LimitOverrunError:
                return await _answer(writer, 431, "text/plain", b"request head too large\n")
            except (asyncio.IncompleteReadError, TimeoutError):
                return None
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
                return await _answer(writer, 405, "text/plain", b"GET only\n")
            path = parts[1].split(b"?", 1)[0]
            body_only = parts[0] == b"GET"
            if path == b"/":
                await _answer(writer, 200, "text/html; charset=utf-8", PAGE.encode(), body_only)
            elif path == b"/status.json":
                body = json.dumps(self.as_json(), sort_keys=True, default=float).encode()
                await _answer(writer, 200, "application/json", body, body_only)
            else:
                await _answer(writer, 404, "text/plain", b"not found\n", body_only)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def serve(self, host: str, port: int, ready: asyncio.Future | None = None) -> None:
        """Serve until cancelled; ``ready`` receives the bound port (port 0: any)."""
        server = await asyncio.start_server(self.handle, host, port, limit=MAX_HEAD_BYTES)
        bound = server.sockets[0].getsockname()[1]
        log.info("status page on http://%s:%d/", host, bound)
        if ready is not None:
            ready.set_result(bound)
        refresher = asyncio.create_task(self.refresh_forever())
        try:
            async with server:
                await server.serve_forever()
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher


async def _answer(writer: asyncio.StreamWriter, code: int, ctype: str, body: bytes, with_body: bool = True) -> None:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}[code]
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + (body if with_body else b""))
    await writer.drain()


def serve_status(
    initial_peers: list[str], *, host: str, port: int, swarm_key: Path | None = None, interval_s: float = 2.0
) -> None:
    """`status --serve`: run the page until Ctrl-C."""
    from rich.console import Console  # noqa: PLC0415

    page = StatusPage(initial_peers, swarm_key, interval_s)

    async def run() -> None:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(page.serve(host, port, ready))
        bound = await ready
        Console(stderr=True).print(f"status page: http://{host}:{bound}/ (JSON: /status.json); Ctrl-C stops it")
        await task

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>locomm swarm</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em} .muted{color:#777} .err{color:#b00}
table{border-collapse:collapse;margin:.8em 0} th,td{padding:.25em .7em;border-bottom:1px solid #ddd;text-align:right}
th{background:#f4f4f4} td.l,th.l{text-align:left;font-family:monospace}
.training{color:#060} .paused{color:#a60} .left{color:#888}
svg{border:1px solid #ddd;background:#fff}
</style></head><body>
<h1>locomm swarm <span id="run" class="muted"></span></h1>
<div id="summary" class="muted">reading the swarm...</div>
<div id="error" class="err"></div>
<table id="peers"><thead><tr><th class="l">peer</th><th>state</th><th>round</th><th>step</th><th>loss</th>
<th>val loss</th><th>tokens/s</th><th>MB sent</th><th>last exchange</th><th>heartbeat age</th></tr></thead>
<tbody></tbody></table>
<h2 style="font-size:1.1em">loss over time</h2>
<svg id="chart" width="760" height="300" role="img" aria-label="each peer's training loss over time"></svg>
<div id="legend" class="muted"></div>
<script>
const COLORS=["#1f77b4","#d62728","#2ca02c","#9467bd","#ff7f0e","#8c564b","#e377c2","#17becf"];
function f(x,d){return x===null||x===undefined?"-":Number(x).toFixed(d)}
function short(p){return p.slice(-8)}
function draw(hist){
  const svg=document.getElementById("chart"),W=760,H=300,L=50,B=30;
  svg.innerHTML="";
  if(!hist.length){return}
  const t0=Math.min(...hist.map(h=>h.t)),t1=Math.max(...hist.map(h=>h.t))||t0+1;
  const lo=Math.min(...hist.map(h=>h.loss)),hi=Math.max(...hist.map(h=>h.loss));
  const x=t=>L+(W-L-10)*(t1>t0?(t-t0)/(t1-t0):0.5), y=v=>10+(H-B-10)*(hi>lo?(hi-v)/(hi-lo):0.5);
  const ns="http://www.w3.org/2000/svg";
  const txt=(s,X,Y,a)=>{const e=document.createElementNS(ns,"text");e.setAttribute("x",X);e.setAttribute("y",Y);
    e.setAttribute("font-size","11");if(a)e.setAttribute("text-anchor",a);e.textContent=s;svg.appendChild(e)};
  txt(f(hi,2),L-4,14,"end");txt(f(lo,2),L-4,H-B,"end");txt("0 s",L,H-10);txt(f(t1-t0,0)+" s",W-10,H-10,"end");
  const peers=[...new Set(hist.map(h=>h.peer))];const legend=document.getElementById("legend");legend.textContent="";
  peers.forEach((p,i)=>{const pts=hist.filter(h=>h.peer===p);const c=COLORS[i%COLORS.length];
    const e=document.createElementNS(ns,"polyline");e.setAttribute("fill","none");e.setAttribute("stroke",c);
    e.setAttribute("stroke-width","2");e.setAttribute("class","curve");
    e.setAttribute("points",pts.map(h=>x(h.t).toFixed(1)+","+y(h.loss).toFixed(1)).join(" "));svg.appendChild(e);
    const k=document.createElement("span");k.style.color=c;k.style.marginRight="1em";k.textContent="\u25a0 "+short(p);
    legend.appendChild(k)});
}
async function tick(){
  try{
    const r=await fetch("status.json",{cache:"no-store"});const d=await r.json();
    document.getElementById("error").textContent=d.error||"";
    const s=d.snapshot;
    if(s){
      document.getElementById("run").textContent="run "+s.run;
      const peers=s.peers||[];const live=peers.filter(p=>p.state!=="left");
      const rounds=live.map(p=>p.round).filter(r=>r!==null&&r!==undefined);
      const top=rounds.length?Math.max(...rounds):"-";
      document.getElementById("summary").textContent=live.length+" peers, round "+top
        +(s.closed?", closed swarm":", open swarm")+", protocol "+s.protocol_version
        +", updated "+new Date(d.updated*1000).toLocaleTimeString();
      const tb=document.querySelector("#peers tbody");tb.innerHTML="";
      for(const p of peers){const tr=document.createElement("tr");tr.className="peer";
        const ago=p.last_exchange_s_ago===null?"-":f(p.last_exchange_s_ago,0)+" s ago";
        const cells=[short(p.peer),p.state,p.round??"-",p.step??"-",f(p.loss,3),f(p.val_loss,3),f(p.tokens_per_s,0),
          f((p.bytes_sent||0)/1e6,1),ago,f(p.heartbeat_age_s,1)+" s"];
        cells.forEach((v,i)=>{const td=document.createElement("td");td.textContent=String(v);  // text, never HTML
          if(i===0){td.className="l";td.title=p.peer}if(i===1){td.className=String(p.state)}tr.appendChild(td)});
        tb.appendChild(tr)}
    }
    draw(d.history||[]);
  }catch(e){document.getElementById("error").textContent="cannot reach the status server: "+e}
}
tick();setInterval(tick,2000);
</script></body></html>
"""
