"""Fair share between API keys on one engine: a key at c=64 against a key at c=2, on vs off.

Two keys share one engine replica whose slots (``max_num_seqs``, 32 here) are fewer than the
requests in flight, so admission decides who runs. Both keys send streaming chats in closed
loops for ``--duration-s``; the same workload runs with ``engine.fair_share`` on and off (vLLM's
own first-come, first-served order), one after the other in one run. Reported side by side:
the small key's TTFT p50/p90 (the ratio off/on), each key's share of the output tokens and the
total throughput.

    python -m loadtest.fair_share [--duration-s 90] [--big 64] [--small 2] [--max-num-seqs 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.client import RequestRecord, make_http, percentile, stream_chat

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"big": "sk-bench-big-0c4f9e2d", "small": "sk-bench-small-7a1b3d5e"}
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Name a primary colour. Answer in one word.",
    "What is 2 + 2? Answer with a number.",
    "Name an animal that barks. Answer in one word.",
]


def body(model: str, key: str, i: int, max_tokens: int) -> dict[str, Any]:
    # A distinct prefix per request: no request is a prefix-cache hit of another.
    text = (
        f"Story {i}: write a long story about a lighthouse keeper."
        if key == "big"
        else f"Question {i}. {QUESTIONS[i % len(QUESTIONS)]}"
    )
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # Every request the same length: shares measure admission only.
        "temperature": 0,
    }


async def tenant(
    url: str, model: str, key: str, concurrency: int, stop_at: float, max_tokens: int
) -> list[tuple[float, float, RequestRecord]]:
    """Closed loop of one key until ``stop_at``: (sent, finished, record) per request."""
    results: list[tuple[float, float, RequestRecord]] = []
    async with make_http(concurrency, timeout_s=900) as http:
        http.headers["authorization"] = f"Bearer {KEYS[key]}"

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                sent = time.monotonic()
                record = await stream_chat(http, url, body(model, key, w * 100_000 + i, max_tokens))
                results.append((sent, time.monotonic(), record))
                i += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return results


async def both(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    stop_at = start + args.warmup_s + args.duration_s
    big, small = await asyncio.gather(
        tenant(url, model, "big", args.big, stop_at, args.max_tokens),
        tenant(url, model, "small", args.small, stop_at, args.max_tokens),
    )
    begin = start + args.warmup_s
    # TTFT: requests sent while both keys were loading (however long they then waited).
    # Token shares: requests that finished in that window.
    out: dict[str, Any] = {}
    tokens = {
        name: sum(r.output_tokens for sent, done, r in results if r.ok and begin <= done <= stop_at)
        for name, results in (("big", big), ("small", small))
    }
    total = max(sum(tokens.values()), 1)
    out["output_tok_per_s"] = total / args.duration_s
    for name, results in (("big", big), ("small", small)):
        sent = [(at, r) for at, _, r in results if begin <= at <= stop_at]
        ok = [r for _, r in sent if r.ok]
        out[name] = {
            "requests": len(sent),
            "failed": len(sent) - len(ok),
            "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
            "ttft_p90_s": percentile([r.ttft_s for r in ok], 90),
            "latency_p50_s": percentile([r.latency_s for r in ok], 50),
            "output_tokens": tokens[name],
            "token_share": tokens[name] / total,
            "records": [{"sent_s": at - start, **r.to_dict()} for at, r in sent],
        }
    return out


def wait_ready(url: str, timeout_s: float = 900) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            models = httpx.get(
                f"{url}/v1/models", headers={"authorization": f"Bearer {KEYS['big']}"}, timeout=10
            )
            if models.status_code == 200:
                return str(models.json()["data"][0]["id"])
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def run_phase(fair: bool, args: argparse.Namespace, keys_file: Path) -> dict[str, Any]:
    import ray
    from ray import serve

    from serve_app.launch import load_serve_config, start

    overrides = {
        "engine": {"max_num_seqs": args.max_num_seqs, "fair_share": {"enabled": fair}},
        "security": {"api_keys_file": str(keys_file)},
    }
    url = start(load_serve_config(ROOT / args.config), port=args.port, overrides=overrides)[0]
    try:
        model = wait_ready(url)
        warm = argparse.Namespace(**{**vars(args), "warmup_s": 0, "duration_s": 3, "big": 2})
        asyncio.run(both(url, model, warm))  # Compile and warm caches; discarded.
        result = asyncio.run(both(url, model, args))
    finally:
        serve.shutdown()
        ray.shutdown()
        time.sleep(2)
    return {"fair_share": fair, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=8079)
    parser.add_argument("--big", type=int, default=64, help="Concurrency of the big key.")
    parser.add_argument("--small", type=int, default=2, help="Concurrency of the small key.")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="Engine slots (contended).")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=90)
    parser.add_argument("--warmup-s", type=float, default=15)
    parser.add_argument("--modes", default="on,off", help="Fair share on, off, or both.")
    parser.add_argument("--out", default="results/fair_share.json")
    args = parser.parse_args(argv)
    modes = [mode == "on" for mode in args.modes.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        keys_file = Path(folder) / "api_keys"
        keys_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        keys_file.chmod(0o600)
        results = [run_phase(fair, args, keys_file) for fair in modes]
    print(
        f"\nbig key c={args.big}, small key c={args.small}, max_num_seqs {args.max_num_seqs}, "
        f"{args.max_tokens} tokens each, {args.duration_s:.0f} s\n"
        f"{'fair share':<11}{'small TTFT p50':>15}{'p90':>8}{'big TTFT p50':>14}"
        f"{'small share':>12}{'big share':>10}{'tok/s':>8}{'small reqs':>11}"
    )
    for r in results:
        small, big = r["small"], r["big"]
        print(
            f"{'on' if r['fair_share'] else 'off':<11}{small['ttft_p50_s'] * 1000:>13.0f}ms"
            f"{small['ttft_p90_s'] * 1000:>6.0f}ms{big['ttft_p50_s'] * 1000:>12.0f}ms"
            f"{small['token_share']:>12.1%}{big['token_share']:>10.1%}"
            f"{r['output_tok_per_s']:>8.1f}{small['requests']:>11}"
        )
    if len(results) == 2:
        on, off = results
        ttft_ratio = off["small"]["ttft_p50_s"] / on["small"]["ttft_p50_s"]
        print(
            f"\nsmall key TTFT p50 off/on: {ttft_ratio:.1f}x   "
            f"throughput on/off: {on['output_tok_per_s'] / off['output_tok_per_s']:.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
