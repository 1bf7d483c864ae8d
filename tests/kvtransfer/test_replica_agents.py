"""The sources of a layer-wise stream from a replica: every rank's live agent, or none.

A decode rank reserves for the stream from every rank of the prefill replica (the worker's
name and its ``<name>.rank<k>`` ranks). What must hold: only that replica's ranks are
named (not another worker whose name merely starts the same), and a replica missing a
rank's handshake (half restarted) is refused, naming it, rather than a stream that would
end "done" without that rank's heads or layers.
"""

from __future__ import annotations

import pytest

from kvtransfer import KVTransferError
from kvtransfer.local_backend import LocalFabric

from .helpers import full_kv, rank_cache
from .test_layer_stream import LAYERS, make_conn


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_every_rank_of_the_replica_or_a_refusal(tp, pp):
    full = full_kv(4, num_layers=LAYERS, num_kv_heads=4)
    fabric = LocalFabric()
    ranks = []
    for stage in range(pp):
        lo, hi = stage * LAYERS // pp, (stage + 1) * LAYERS // pp
        for r in range(tp):
            name = "p" if not ranks else f"p.rank{len(ranks)}"
            cache = rank_cache(full, r, tp)[:, lo:hi].contiguous()
            ranks.append(make_conn(fabric, name, cache, tp_rank=r, tp_size=tp, first_layer=lo))
    other = make_conn(fabric, "p.rankless", full.clone())  # another worker, not a rank of p
    decode = make_conn(fabric, "d", full.clone())
    try:
        decode.add_peer(ranks[0].metadata())
        decode.add_peer(other.metadata())
        with pytest.raises(KVTransferError, match="1 ranks handshaken"):
            decode.replica_agents("p")
        decode.add_peer(ranks[1].metadata())
        assert decode.replica_agents("p") == tuple(sorted(c.agent_name for c in ranks))
        assert decode.replica_agents("p.rankless") == (other.agent_name,)
        with pytest.raises(KVTransferError, match="no KV handshake with q"):
            decode.replica_agents("q")
    finally:
        for conn in [*ranks, other, decode]:
            conn.close()
