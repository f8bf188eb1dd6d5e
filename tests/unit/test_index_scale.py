"""Pure parts of the scaled-out index (issue 16): chain groups (what the Redis Cluster backend keys
by), the event mapper's positions and anchors, and read-only replicas (``index.ingest_events``)."""

from __future__ import annotations

from orchestrator.config import load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.kv.events import KvEventMapper
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import GROUP_BLOCKS, chain_anchors
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.tracker import PrefixTracker, build_prefix_tracker
from orchestrator.router.types import RouteDecision, RouteRequest

BS = 4


def test_chain_anchors_group_by_position():
    hs = list(range(100, 100 + 2 * GROUP_BLOCKS + 3))
    a = chain_anchors(hs)
    assert a[:GROUP_BLOCKS] == [100] * GROUP_BLOCKS
    assert a[GROUP_BLOCKS:2 * GROUP_BLOCKS] == [100 + GROUP_BLOCKS] * GROUP_BLOCKS
    assert a[-1] == 100 + 2 * GROUP_BLOCKS
    # a later piece of the same chain gets the same anchors as the whole chain
    assert chain_anchors(hs[5:], first_position=5, first_anchor=100) == a[5:]


def test_mapper_anchors_match_what_a_reader_computes_from_the_prompt():
    """Events arrive in pieces (a prompt's blocks over several steps, a later turn extending it);
    each block's anchor must equal the one a lookup computes from position 0 of the prompt."""
    tokens = list(range(1000, 1000 + BS * 40))
    ours = BlockHasher("m", BS).hash_blocks(tokens)
    m = KvEventMapper("w", lambda: "m")
    got: list[int] = []
    pieces = [(0, 7), (7, 20), (20, 33), (33, 40)]
    for a, b in pieces:
        ev = {"type": "BlockStored", "block_hashes": [9000 + i for i in range(a, b)],
              "parent_block_hash": 9000 + a - 1 if a else None, "token_ids": tokens[a * BS:b * BS],
              "block_size": BS, "medium": "GPU"}
        op = m.apply(ev)
        assert op.hashes == ours[a:b]
        got += op.anchors
    assert got == chain_anchors(ours)
    # a token-less offload of known blocks carries their anchors too
    op = m.apply({"type": "BlockStored", "block_hashes": [9000 + 17, 9000 + 35], "token_ids": [], "block_size": 0,
                  "medium": "CPU"})
    assert op.anchors == [chain_anchors(ours)[17], chain_anchors(ours)[35]]


def _tracker(ingest: bool) -> tuple[PrefixTracker, FleetRegistry]:
    cfg = load_config({
        "models": [{"name": "m", "tokenizer": "sim", "block_size": BS}],
        "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "engine": "sim", "models": ["m"],
                     "kv_events": {"endpoint": "tcp://127.0.0.1:9"}},
                    {"id": "w1", "url": "http://127.0.0.1:10", "engine": "sim", "models": ["m"]}],
        "router": {"policy": "kv_aware"},
        "index": {"ingest_events": ingest},
    }, environ={})
    fleet = FleetRegistry.from_config(cfg)
    for w in fleet.workers():
        fleet.record_health(w, True, 0.0)
    return build_prefix_tracker(cfg, fleet), fleet


async def test_read_only_replica_neither_subscribes_nor_guesses_for_event_fed_workers():
    writer, _ = _tracker(True)
    reader, fleet = _tracker(False)
    writer._subscribe(fleet.get("w0"))  # what start() does (no socket is opened before start)
    assert "w0" in writer.subscribers
    assert reader.subscribers == {} and reader.ingest_events is False
    req = RouteRequest(request_id="r", model="m", prompt_tokens=8, block_size=BS, block_hashes=[1, 2])
    for wid in ("w0", "w1"):
        await reader.on_routed(req, RouteDecision(worker=fleet.get(wid), policy="kv_aware", reason=""), 0.0)
    assert isinstance(reader.index, MemoryPrefixIndex)
    assert await reader.index.worker_blocks("w0") == 0  # event-fed: the writers' events fill it
    assert await reader.index.worker_blocks("w1") == 2  # no events at all: approximate, as before


def test_rendezvous_owner_moves_only_the_leaving_replicas_workers():
    from orchestrator.kv.ingest_shards import owner

    workers = [f"engine-{i}" for i in range(1000)]
    four = ["r1", "r2", "r3", "r4"]
    before = {w: owner(w, four) for w in workers}
    counts = {r: sum(1 for o in before.values() if o == r) for r in four}
    assert all(180 < c < 320 for c in counts.values()), counts  # spread evenly
    after = {w: owner(w, ["r1", "r2", "r4"]) for w in workers}
    moved = [w for w in workers if before[w] != after[w]]
    assert moved and all(before[w] == "r3" for w in moved)  # only r3's workers move
    assert owner("x", []) is None
