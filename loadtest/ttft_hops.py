"""Where the time to first token goes at c=1, hop by hop, from the traces the app emits.

``python -m loadtest.ttft_hops [--requests 40] [--config serve_config.cpu.yaml]``

Starts the app with the in-memory span exporter, sends streamed chat requests one at a time,
and joins each request's client-side times with its router, preprocess and engine spans (one
trace per request; every process stamps with the same wall clock on one machine). Prints the
median and p90 of each hop:

  ingress          client send → the router's span starts (HAProxy/proxy, HTTP parse, validation;
                   one keep-alive connection)
  router           router span start → sent to the preprocessor (auth, limits, model lookup)
  preprocess       render, aggregation window, tokenize (its own span)
  to engine        preprocess done → engine.generate starts (result back, routing, the hop)
  engine replica   engine.generate start → vLLM queued the request
  engine queue     vLLM queued → scheduled
  prefill          scheduled → first token in the engine core
  output           first token in the engine core → the engine replica has it
  back             engine replica has it → the client reads the first chunk
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
HOPS = [
    "ingress",
    "router",
    "preprocess",
    "to engine",
    "engine replica",
    "engine queue",
    "prefill",
    "output",
    "back",
]


def keep_alive_client() -> httpx.Client:
    """One connection for every request, as a benchmark client or an SDK keeps it, with
    TCP_NODELAY: httpx writes headers and body apart, and Nagle's algorithm would hold the body
    for the server's delayed ACK (~40 ms, which a new connection per request also pays)."""
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    return httpx.Client(transport=httpx.HTTPTransport(socket_options=nodelay), timeout=120)


def first_chunk(http: httpx.Client, url: str, model: str, i: int) -> tuple[int, int, str]:
    """(send ns, first content chunk ns, traceparent) of one streamed chat request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Name a color ({i})."}],
        "max_tokens": 2,
        "stream": True,
    }
    sent = time.time_ns()
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        trace = response.headers.get("traceparent", "")
        first = 0
        for line in response.iter_lines():
            if not first and '"content":"' in line and '"content":""' not in line:
                first = time.time_ns()
    return sent, first, trace.split("-")[1] if trace else ""


def hops_of(client: tuple[int, int], spans: list[dict[str, Any]]) -> dict[str, float] | None:
    """Milliseconds per hop of one trace, or None when a span is missing."""
    by_name = {s["name"]: s for s in spans}
    router = next((s for s in spans if s["name"].startswith("POST ")), None)
    pre, gen = by_name.get("preprocess"), by_name.get("engine.generate")
    queue, prefill = by_name.get("engine.queue"), by_name.get("engine.prefill")
    if None in (router, pre, gen, queue, prefill) or not client[1]:
        return None
    assert router and pre and gen and queue and prefill
    engine_first = gen["start_ns"] + gen["attributes"]["serve_app.ttft_ms"] * 1e6
    marks = [
        client[0],
        router["start_ns"],
        pre["start_ns"],
        pre["end_ns"],
        gen["start_ns"],
        queue["start_ns"],
        queue["end_ns"],
        prefill["end_ns"],
        engine_first,
        client[1],
    ]
    return {hop: (b - a) / 1e6 for hop, a, b in zip(HOPS, marks[:-1], marks[1:], strict=True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--config", default=str(ROOT / "serve_config.cpu.yaml"))
    ns = p.parse_args(argv)
    from ray import serve

    from serve_app.launch import load_serve_config, start, wait_ready

    config = load_serve_config(ns.config)
    app = config["applications"][0]
    model = (app.get("args") or {}).get("model", {}).get("name", "smollm2-135m-instruct")
    (url,) = start(config, port=8497, overrides={"tracing": {"exporter": "memory"}})[:1]
    try:
        wait_ready(url)
        http = keep_alive_client()
        for i in range(5):  # Warm-up: first-use compilation, caches, the connection.
            first_chunk(http, url, model, -i)
        clients = {}
        for i in range(ns.requests):
            sent, first, trace = first_chunk(http, url, model, i)
            clients[trace] = (sent, first)
        spans: dict[str, list[dict[str, Any]]] = defaultdict(list)
        name = app.get("name", "default")
        for deployment in ("Router", "Preprocessor", "Engine"):
            handle = serve.get_deployment_handle(deployment, app_name=name)
            for span in handle.finished_spans.remote().result(timeout_s=60):
                spans[span["trace_id"]].append(span)
        rows = [h for t, c in clients.items() if (h := hops_of(c, spans.get(t, [])))]
    finally:
        serve.shutdown()
    if not rows:
        print("no complete traces (is tracing on?)", file=sys.stderr)
        return 1
    print(f"TTFT at c=1 by hop, {len(rows)} requests (ms)")
    print(f"  {'hop':<16}{'p50':>8}{'p90':>8}")
    columns = {hop: [r[hop] for r in rows] for hop in HOPS}
    columns["TTFT (client)"] = [sum(r.values()) for r in rows]
    for hop, values in columns.items():
        values.sort()
        print(f"  {hop:<16}{statistics.median(values):>8.1f}{values[int(0.9 * len(values))]:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
