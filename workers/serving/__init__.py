"""A worker as a service: the engine's thread and its commands (`EngineService`), the Ray
actors of a worker and of a follower rank, the router-worker channel, worker metrics and
the worker's spec.

May import: everything below it in `workers/` (`parallel`, `engine`, `models`, `protocol`,
`text`), `kvtransfer`, Ray, prometheus-client; never `router` or `cluster`.
"""
