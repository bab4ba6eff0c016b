"""The routing simulator runs the real policy and Serve's real router, and tells them apart."""

from __future__ import annotations

from loadtest.routing_sim import Params, Workload, simulate


def test_ours_keeps_the_cache_serve_default_loses_it_and_hashing_piles_up() -> None:
    p = Params(n_prompts=300, hot_share=0.2)
    wl = Workload(p, 8, 3000)
    ours, default, chash = (simulate(name, 8, wl, p) for name in ("ours", "serve-default", "chash"))
    assert ours["hit"] > 1.2 * default["hit"]
    assert ours["hit"] > 0.85 * wl.ideal_hit
    assert ours["ttft_p50"] < default["ttft_p50"]
    assert chash["qmax"] > 3 * ours["qmax"]  # A hot prompt on one replica.
    assert 0 < ours["spill"] < 0.2
