"""A rank other than 0 as a Ray actor (rank 0 is ``ray_worker.WorkerActor``).

It loads its shard of the weights (its TP slice of its pipeline stage's layers),
allocates its heads of its layers' KV cache, opens its own
KV connector (its own NIXL agent, so decode ranks pull exactly their heads from the
prefill ranks that hold them) and then follows rank 0's commands on a thread
(``workers/parallel/replica_follower.py``). The router never talks to it; bring-up only asks it
for its KV metadata and introduces its peers. When rank 0 goes away (stop command, or
its connections close) the thread ends, the connector closes and the rank leaves the
process group. Same conventions as ``ray_worker``: msgpack-able arguments, errors
returned as strings.
"""

from __future__ import annotations

import logging
import os
import threading

from workers.serving.worker_spec import WorkerSpec, build_engine, connector_factory

logger = logging.getLogger(__name__)


class RankActor:
    def __init__(self, spec_bytes: bytes, rank: int):
        self.spec = WorkerSpec.from_bytes(spec_bytes)
        self.rank = rank
        self._follower = None
        self._thread: threading.Thread | None = None
        self.error = ""  # why the follower stopped, if it did not stop on command

    def start(self, address: str, port: int) -> str:
        """Join rank 0's process group, load this rank's shard, follow; "" or the error."""
        try:
            self._start(address, port)
        except Exception as exc:
            logger.exception("%s rank %d failed to start", self.spec.name, self.rank)
            return f"{type(exc).__name__}: {exc}"
        return ""

    def _start(self, address: str, port: int) -> None:
        from workers.parallel.replica import agree_min, join_replica
        from workers.parallel.replica_follower import RankFollower

        spec = self.spec
        device_type = "cuda" if spec.engine.device.startswith("cuda") else "cpu"
        parallel, link = join_replica(
            self.rank, spec.num_ranks, address, port, device_type, spec.pipeline_parallel
        )
        engine = build_engine(spec, parallel, agree=agree_min(link))
        follower = RankFollower(engine, link, spec.dst_tensor_parallel, spec.dst_pipeline_parallel)
        follower.connector = connector_factory(spec, self.rank)(engine, follower.on_release)
        self._follower = follower
        self._thread = threading.Thread(
            target=self._follow, name=f"rank-{spec.name}-{self.rank}", daemon=True
        )
        self._thread.start()
        logger.info("%s rank %d ready in pid %d", spec.name, self.rank, os.getpid())

    def _follow(self) -> None:
        from workers.parallel.replica import leave_replica

        follower = self._follower
        try:
            follower.run()
        except Exception as exc:  # rank 0 is gone (or sent nonsense): stop serving
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s rank %d stops following: %s", self.spec.name, self.rank, exc)
        finally:
            if follower.connector is not None:
                follower.connector.close()  # its leases end; pending receives fail
            leave_replica()

    def kv_metadata(self) -> bytes:
        return self._follower.connector.metadata()

    def add_peer(self, metadata: bytes) -> str:
        try:
            self._follower.connector.add_peer(metadata)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def stop(self, timeout_s: float = 10.0) -> str:
        """Wait for rank 0's stop command to end the follower (rank 0 is stopped first)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return "still following rank 0"
        return self.error
