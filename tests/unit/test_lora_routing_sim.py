"""The LoRA routing simulator: the real policy keeps each adapter on few replicas."""

from __future__ import annotations

from loadtest.lora_routing_sim import Params, Workload, simulate


def test_adapter_aware_routing_loads_adapters_far_less_often_than_blind_routing() -> None:
    p = Params(n_adapters=32)
    wl = Workload(p, 8, 3000)
    ours, blind, default = (
        simulate(name, 8, wl, p) for name in ("ours", "adapter-blind", "serve-default")
    )
    assert ours["loads_per_1k"] < 0.5 * blind["loads_per_1k"]
    assert ours["loads_per_1k"] < 0.5 * default["loads_per_1k"]
    assert ours["replicas_per_adapter"] < 0.6 * default["replicas_per_adapter"]
    assert ours["ttft_p50"] < default["ttft_p50"]
