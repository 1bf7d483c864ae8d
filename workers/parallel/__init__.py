"""Tensor/pipeline-parallel plumbing of one replica: joining the ranks' process group, the
rank link that carries rank 0's step commands, follower ranks, and the replica's KV
hand-off across ranks (`ReplicaKV`).

May import: `workers.engine`, `workers.models`, `workers.protocol`, `kvtransfer`, torch;
never `workers.serving`.
"""
