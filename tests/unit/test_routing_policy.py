"""Cache-aware routing policy: block hashes, the per-replica index, the choice (no Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig, RoutingConfig
from serve_app.engine.routing.index import PrefixIndex
from serve_app.engine.routing.policy import RoutingPolicy
from serve_app.preprocess.block_hashes import block_hashes

BS = 16


def toks(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 150_000 for i in range(n)]


SYSTEM = toks(1, 10 * BS)  # A 10-block shared system prompt.


def req(seed: int, prefix: list[int] = SYSTEM, n_suffix: int = 3 * BS) -> tuple[int, ...]:
    return block_hashes(prefix + toks(1000 + seed, n_suffix), BS)


def policy(n: int = 4, **routing: Any) -> RoutingPolicy:
    p = RoutingPolicy(RoutingConfig(block_size=BS, **routing), seed=0)
    p.set_replicas([f"r{i}" for i in range(n)])
    return p


def idle(n: int = 4) -> dict[str, int]:
    return {f"r{i}": 0 for i in range(n)}


# ---- block hashes ---------------------------------------------------------------------
def test_block_hashes_cover_full_blocks_only_and_are_bounded() -> None:
    assert block_hashes([], BS) == ()
    assert block_hashes(toks(0, BS - 1), BS) == ()
    assert len(block_hashes(toks(0, 5 * BS + 7), BS)) == 5
    assert len(block_hashes(toks(0, 100 * BS), BS, max_blocks=8)) == 8


def test_block_hashes_are_chained_prefix_hashes() -> None:
    a, b = toks(1, 4 * BS), toks(2, 3 * BS)
    ha, hab = block_hashes(a, BS), block_hashes(a + b, BS)
    assert hab[:4] == ha  # Same prefix, same leading hashes.
    changed = list(a)
    changed[2 * BS + 3] += 1  # One token in block 2 changes blocks 2.. only.
    hc = block_hashes(changed, BS)
    assert hc[:2] == ha[:2] and all(x != y for x, y in zip(hc[2:], ha[2:], strict=True))
    # Equal block content at another position is another prefix.
    assert block_hashes(b[:BS] * 2, BS)[1] != block_hashes(b[:BS], BS)[0]
    assert block_hashes(a, BS, salt=b"adapter-1") != ha
    assert all(0 <= h < 2**64 for h in ha)


def test_block_hashes_are_the_same_in_every_process() -> None:
    code = (
        "from serve_app.preprocess.block_hashes import block_hashes;"
        "print(block_hashes(list(range(64)), 16))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(block_hashes(list(range(64)), 16))}


# ---- index ----------------------------------------------------------------------------
def test_index_is_bounded_and_trims_prefix_tails_first() -> None:
    index = PrefixIndex(default_capacity=20)
    index.add_replica("a")
    first = req(0)  # 13 blocks.
    index.insert("a", first)
    assert index.match_depth("a", first) == 13
    index.insert("a", req(1))  # 10 shared + 3 new = 16 distinct.
    index.insert("a", block_hashes(toks(99, 12 * BS), BS))  # 12 unrelated: overflow.
    assert index.size("a") == 20
    assert index.holds("a", first[0])  # The shared head stays; tails went first.
    assert index.match_depth("a", first) < 13
    index.set_capacity("a", 5)  # A smaller reported KV cache trims at once.
    assert index.size("a") == 5 and index.capacity("a") == 5


def test_index_forgets_a_removed_replica_completely() -> None:
    index = PrefixIndex(default_capacity=100)
    for r in ("a", "b"):
        index.add_replica(r)
        index.insert(r, req(0))
    assert index.owners(req(0)[0]) == {"a", "b"}
    index.remove_replica("a")
    assert index.owners(req(0)[0]) == {"b"}
    index.remove_replica("b")
    assert all(not index.owners(h) for h in req(0))
    index.insert("gone", req(0))  # An unknown replica is not resurrected.
    assert index.replicas() == [] and not index.owners(req(0)[0])


def test_longest_match_picks_the_deepest_holder_among_candidates() -> None:
    index = PrefixIndex(default_capacity=100)
    for r in ("a", "b", "c"):
        index.add_replica(r)
    index.insert("a", block_hashes(SYSTEM, BS))  # The system prompt only.
    index.insert("b", req(5))  # The system prompt and this conversation.
    assert index.longest_match(req(5), {"a", "b", "c"}) == (13, {"b"})
    assert index.longest_match(req(5), {"a", "c"}) == (10, {"a"})


# ---- choose ---------------------------------------------------------------------------
def test_a_shared_prefix_sticks_to_one_replica() -> None:
    p = policy()
    first = p.choose(req(0), idle())
    assert first.reason == "balance"
    for s in range(1, 20):
        d = p.choose(req(s), idle())
        assert (d.replica, d.reason, d.matched_blocks) == (first.replica, "affinity", 10)
    assert p.counts == Counter({"balance": 1, "affinity": 19})


def test_spills_past_the_margin_and_remembers_the_copy() -> None:
    p = policy(spill_margin=2, spill_ratio=0.0)
    q = idle()
    home = p.choose(req(0), q).replica
    q[home] = 2  # Within the margin (2 - 0 <= 2): stay.
    assert p.choose(req(1), q).reason == "affinity"
    q[home] = 3  # Beyond it: spill to the least loaded.
    d = p.choose(req(2), q)
    assert d.reason == "spill" and d.replica != home and q[d.replica] == 0
    assert p.index.owners(req(0)[0]) == {home, d.replica}
    # Two holders now: affinity takes the less loaded one without spilling.
    assert p.choose(req(3), q).replica == d.replica


def test_the_margin_grows_with_load() -> None:
    p = policy(n=2, spill_margin=1, spill_ratio=0.5)
    q = {"r0": 10, "r1": 10}
    home = p.choose(req(0), q).replica
    other = "r1" if home == "r0" else "r0"
    q[home] = 15  # 10 + max(1, 0.5 * 10) = 15: still affine.
    assert p.choose(req(1), q).replica == home
    q[home] = 16
    assert p.choose(req(2), q).replica == other


def test_warm_spill_prefers_a_replica_with_the_shorter_prefix() -> None:
    p = policy(spill_margin=1, spill_ratio=0.0)
    q = idle()
    p.index.insert("r1", block_hashes(SYSTEM, BS))  # r1 holds the system prompt only.
    p.index.insert("r2", req(7))  # r2 holds this whole conversation, but is busy.
    q["r2"] = 5
    d = p.choose(req(7, n_suffix=4 * BS), q)
    assert (d.replica, d.reason, d.matched_blocks) == ("r1", "spill", 10)


def test_no_hashes_go_to_the_least_loaded() -> None:
    d = policy().choose((), {"r0": 3, "r1": 1, "r2": 2, "r3": 5})
    assert (d.replica, d.reason) == ("r1", "balance")


@pytest.mark.parametrize("cold", ["least_loaded", "hrw"])
def test_independent_callers_place_a_new_prefix_alike(cold: str) -> None:
    a, b = policy(16, cold_placement=cold), policy(16, cold_placement=cold)
    b.set_replicas(reversed(list(idle(16))))  # Order must not matter.
    prefixes = [req(0, prefix=toks(s, 4 * BS)) for s in range(50)]
    picks = [a.choose(h, idle(16)).replica for h in prefixes]
    assert picks == [b.choose(h, idle(16)).replica for h in prefixes]
    assert len(set(picks)) > 8  # And they spread.


def test_a_new_prefix_goes_to_the_emptier_cache() -> None:
    p = policy(n=2, index_blocks_per_replica=100, cold_placement="least_loaded")
    p.index.insert("r0", block_hashes(toks(50, 40 * BS), BS))  # r0's cache is 40 % full.
    new = [req(0, prefix=toks(s, 4 * BS)) for s in range(20)]
    assert {p.choose(h, idle(2)).replica for h in new[:5]} == {"r1"}
    # Once the fills are within FILL_SLACK, the rendezvous hash spreads new prefixes again.
    assert {p.choose(h, idle(2)).replica for h in new[5:]} == {"r0", "r1"}


def test_hrw_placement_ignores_fill_so_independent_callers_agree() -> None:
    a, b = policy(n=2, cold_placement="hrw"), policy(n=2, cold_placement="hrw")
    a.index.insert("r0", block_hashes(toks(50, 40 * BS), BS))  # Only a has seen this.
    new = [req(0, prefix=toks(s, 4 * BS)) for s in range(20)]
    assert [a.choose(h, idle(2)).replica for h in new] == [
        b.choose(h, idle(2)).replica for h in new
    ]


def test_sessions_stick_and_only_a_leaving_replicas_sessions_move() -> None:
    p = policy(n=8)
    q = idle(8)
    home = {f"s{k}": p.choose((), q, session_key=f"s{k}").replica for k in range(400)}
    assert all(
        p.choose(req(k), q, session_key=s).replica == h for k, (s, h) in enumerate(home.items())
    )
    spread = Counter(home.values())
    assert len(spread) == 8 and max(spread.values()) < 2.0 * 400 / 8
    p.remove_replica("r3")
    q.pop("r3")
    moved = {s for s, h in home.items() if p.choose((), q, session_key=s).replica != h}
    assert moved == {s for s, h in home.items() if h == "r3"}


def test_an_overloaded_session_home_falls_through_and_returns() -> None:
    p = policy(spill_margin=2, spill_ratio=0.0)
    q = idle()
    home = p.choose((), q, session_key="abc").replica
    q[home] = 10
    d = p.choose(req(0), q, session_key="abc")
    assert d.replica != home and d.reason == "balance"
    q[home] = 0
    assert p.choose(req(1), q, session_key="abc").replica == home


def test_replicas_leaving_and_joining() -> None:
    p = policy(n=3)
    q = idle(3)
    home = p.choose(req(0), q).replica
    p.set_replicas([n for n in q if n != home])
    q.pop(home)
    d = p.choose(req(1), q)
    assert d.replica != home and d.reason == "balance"  # Its blocks were forgotten.
    assert home not in p.index.replicas()
    p.set_replicas([*q, home])  # It rejoins cold.
    assert p.index.size(home) == 0
    # Candidates may name a replica set_replicas has not seen yet.
    assert p.choose(req(2), {"new": 0}, candidates=["new"]).replica == "new"


def test_reported_kv_capacity_sizes_the_index_unless_fixed() -> None:
    p = policy(n=1)
    p.set_kv_capacity("r0", 46_592)
    assert p.index.capacity("r0") == 46_592 // BS
    fixed = policy(n=1, index_blocks_per_replica=100)
    fixed.set_kv_capacity("r0", 46_592)
    assert fixed.index.capacity("r0") == 100


def test_session_policy_keeps_no_index() -> None:
    p = policy(policy="session")
    d = p.choose(req(0), idle())
    assert d.reason == "balance" and p.index.size(d.replica) == 0
    assert p.choose((), idle(), session_key="x").reason == "session"


def test_an_adapters_new_prompts_go_where_it_is_loaded_and_spread_only_under_load() -> None:
    """Each adapter has a home by rendezvous hash of its name, the same in every caller; its
    requests stay there while it is within the margin, then take the next in its order."""
    a, b = (
        policy(n=8, spill_margin=2, spill_ratio=0.0),
        policy(n=8, spill_margin=2, spill_ratio=0.0),
    )
    b.set_replicas(reversed(list(idle(8))))  # Order must not matter.
    q = idle(8)
    prompts = [req(0, prefix=toks(s, 4 * BS)) for s in range(30)]  # Nothing shared.
    homes = {a.choose(h, q, adapter="poet").replica for h in prompts}
    assert len(homes) == 1
    home = homes.pop()
    assert a.counts["adapter"] == 30
    assert {b.choose(h, q, adapter="poet").replica for h in prompts} == {home}
    assert {a.choose((), q, adapter="poet").replica for _ in range(5)} == {home}  # No hashes.
    # Adapters spread over the fleet by name.
    names = [f"adapter-{k}" for k in range(64)]
    spread = Counter(a.choose((), q, adapter=name).replica for name in names)
    assert len(spread) == 8 and max(spread.values()) < 3 * 64 / 8
    # The home past the margin: the adapter's second replica takes it, the same everywhere.
    q[home] = 3
    second = a.choose(req(99, prefix=toks(99, 4 * BS)), q, adapter="poet")
    assert second.replica != home and second.reason == "adapter"
    assert b.choose(req(98, prefix=toks(98, 4 * BS)), q, adapter="poet").replica == second.replica


def test_a_cached_adapter_prefix_keeps_its_affinity() -> None:
    p = policy(n=8)
    q = idle(8)
    first = p.choose(req(0), q, adapter="poet")
    assert first.reason == "adapter"
    follow_up = p.choose(req(1), q, adapter="poet")
    assert (follow_up.replica, follow_up.reason) == (first.replica, "affinity")


# ---- config ---------------------------------------------------------------------------
def test_routing_config_defaults_and_bounds() -> None:
    routing = AppConfig().engine.routing
    assert routing.policy == "prefix_aware" and routing.hashes_needed()
    assert routing.session_header == "x-session-id"
    assert RoutingConfig(session_header="X-Conversation").session_header == "x-conversation"
    for bad, fragment in [
        ({"block_size": 40}, "multiple of 16"),
        ({"spill_margin": -1}, "greater than or equal to 0"),
        ({"policy": "round_robin"}, "prefix_aware"),
        ({"index_blocks_per_replica": 0}, "greater than or equal to 1"),
    ]:
        with pytest.raises(ValidationError, match=fragment):
            AppConfig.model_validate({"engine": {"routing": bad}})
