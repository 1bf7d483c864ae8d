"""``baton profile``: measure the step times of a cluster config's model on this machine and
write them for the planner (``planner.profile``; cluster/profile_run.py, docs/planner.md).

Registered in ``cli.py``'s command table; heavy imports (torch, the engine) stay inside
``run``.
"""

from __future__ import annotations

import argparse
import os

from cluster.cli_terminal import PROG


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        metavar="CONFIG",
        nargs="?",
        default=None,
        help="cluster config YAML whose model and pool settings to profile (default: the "
        "embedded default)",
    )
    parser.add_argument(
        "--out",
        default="baton-profile.json",
        metavar="FILE",
        help="where to write the profile (baton-profile.json); point planner.profile at it",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads on CPU (default: what `baton serve` gives each rank of this "
        "config on a local Ray instance)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small grid (two repeats, prompts up to 256 tokens, batches up to 8): "
        "seconds, for a smoke test; the planner's fits will lean on serving",
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from cluster.bringup import local_rank_threads
    from cluster.config import engine_config, load_config
    from cluster.model_source import resolve_model_dir, served_name
    from cluster.planner.profile import save_profile
    from cluster.profile_run import Grid, run_profile

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(args.config)
    pools = (("prefill", config.prefill), ("decode", config.decode))
    for role, pool in pools:
        if pool.tensor_parallel > 1 or pool.pipeline_parallel > 1:
            raise ValueError(
                f"{role}: tensor_parallel {pool.tensor_parallel}, pipeline_parallel "
                f"{pool.pipeline_parallel}: baton profile runs one rank; profile a config "
                "with single-rank pools, or let the planner learn this one online"
            )
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    model_dir = resolve_model_dir(config.model.path)
    name = served_name(config.model.name, model_dir)
    num_ranks = config.prefill.replicas + config.decode.replicas
    threads = args.threads or local_rank_threads(
        os.cpu_count() or 1, config.router.reserved_cpus, num_ranks
    )
    grid = Grid()
    if args.quick:
        grid = Grid(repeats=2, decode_steps=2, max_prompt=256, max_setup_tokens=2048, max_batch=8)
    engines = [
        engine_config(config, p, model=str(model_dir), device=_device(p.device)) for _, p in pools
    ]
    where = "cuda" if engines[1].device == "cuda" else f"{threads} CPU thread(s)"
    print(f"{PROG} profile: {name} on {where}", flush=True)
    profile = run_profile(*engines, name, threads, grid, say=lambda s: print(s, flush=True))
    save_profile(profile, args.out)
    print(
        f"{PROG} profile: {len(profile.prefill)} prefill and {len(profile.decode)} decode "
        f"records in {profile.seconds:.0f} s -> {args.out} (planner.profile)"
    )
    return 0


def _device(setting: str) -> str:
    """A pool's device as ``baton serve`` resolves it on this machine (``auto``: a GPU if
    there is one)."""
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
