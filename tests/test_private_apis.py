"""Every private API of a dependency that Baton calls, in one place (docs/dependencies.md).

A private name (``torch.ops.aten._weight_int4pack_mm_for_cpu``, ``ray._private``,
``nixl._bindings``, uvicorn's ``Server.startup``) carries no compatibility promise: an
upgrade inside the declared range may remove or change it. Each entry below names the
attribute path, the parameters we pass by name, and the code that calls it; the tests fail
loudly, with that code's path, when the installed version lacks one. A new private call
goes here in the same change (review looks for it); docs/dependencies.md explains the
version bounds these entries justify.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class PrivateAPI:
    path: str  # module[:attribute.chain]
    used_by: str  # where we call it
    params: tuple[str, ...] = ()  # parameters we pass by name (checked in the signature)


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    # torch: oneDNN weight packing and the CPU INT4 matmul (no public equivalents), and the
    # C++ extension's build directory (where the file lock goes).
    PrivateAPI("torch:ops.mkldnn._reorder_linear_weight", "kernels/cpu_linear.py"),
    PrivateAPI("torch:ops.mkldnn._linear_pointwise", "kernels/cpu_linear.py"),
    PrivateAPI("torch:ops.mkldnn._is_mkldnn_bf16_supported", "tests/kernels/test_cpu_linear.py"),
    PrivateAPI("torch:ops.aten._convert_weight_to_int4pack_for_cpu", "kernels/int4_linear.py"),
    PrivateAPI("torch:ops.aten._weight_int4pack_mm_for_cpu", "kernels/int4_linear.py"),
    PrivateAPI("torch.utils.cpp_extension:_get_build_directory", "kernels/cpu_extension.py"),
    # uvicorn: serving on a socket we bound, inside our own event loop (not uvicorn.run).
    PrivateAPI("uvicorn:Config.load", "router/http/server.py"),
    PrivateAPI("uvicorn:Server.startup", "router/http/server.py", ("sockets",)),
    PrivateAPI("uvicorn:Server.main_loop", "router/http/server.py"),
    PrivateAPI("uvicorn:Server.shutdown", "router/http/server.py", ("sockets",)),
    # prometheus-client: switching a process to multiprocess values after import.
    PrivateAPI("prometheus_client.values:ValueClass", "workers/serving/metrics_node.py"),
    PrivateAPI("prometheus_client.values:MultiProcessValue", "workers/serving/metrics_node.py"),
    # Ray: whether the GCS / raylet that `baton serve` started are still alive.
    PrivateAPI("ray._private.worker:_global_node", "cluster/bringup.py"),
    PrivateAPI("ray._private.ray_constants:PROCESS_TYPE_GCS_SERVER", "cluster/bringup.py"),
    PrivateAPI("ray._private.ray_constants:PROCESS_TYPE_RAYLET", "cluster/bringup.py"),
    PrivateAPI(
        "ray._private.authentication_test_utils:reset_auth_token_state",
        "tests/e2e/test_multinode_cluster.py",
    ),
    # NIXL: the bindings under nixl._api (docs/kvtransfer.md says why not the wrapper).
    *(
        PrivateAPI(f"nixl._bindings:{name}", "kvtransfer/nixl_backend.py")
        for name in (
            "nixlAgent",
            "nixlAgentConfig",
            "nixlRegDList",
            "nixlXferDList",
            "DRAM_SEG",
            "VRAM_SEG",
            "NIXL_INIT_AGENT",
            "NIXL_READ",
            "NIXL_WRITE",
            "NIXL_SUCCESS",
            "NIXL_IN_PROG",
            "NIXL_THREAD_SYNC_NONE",
            *(
                f"nixlAgent.{method}"
                for method in (
                    "createBackend",
                    "deregisterMem",
                    "genNotif",
                    "getAvailPlugins",
                    "getLocalMD",
                    "getNotifs",
                    "getXferStatus",
                    "invalidateRemoteMD",
                    "loadRemoteMD",
                    "makeConnection",
                    "makeXferReq",
                    "postXferReq",
                    "prepXferDlist",
                    "registerMem",
                    "releaseXferReq",
                    "releasedDlistH",
                )
            ),
        )
    ),
)


def resolve(path: str) -> object:
    """The object at ``module:attr.chain``; AttributeError / ImportError when gone."""
    module_name, _, chain = path.partition(":")
    obj: object = importlib.import_module(module_name)
    for name in chain.split(".") if chain else ():
        obj = getattr(obj, name)
    return obj


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: api.path)
def test_private_api_still_exists(api: PrivateAPI) -> None:
    try:
        obj = resolve(api.path)
    except (ImportError, AttributeError, RuntimeError) as exc:  # torch.ops raises RuntimeError
        pytest.fail(
            f"{api.path} is gone in the installed version ({exc}); {api.used_by} calls it: "
            "port that code, or bound the dependency below this version in pyproject.toml"
        )
    if api.params:
        params = inspect.signature(obj).parameters  # type: ignore[arg-type]
        missing = [p for p in api.params if p not in params]
        assert not missing, (
            f"{api.path} no longer takes {missing} (has {list(params)}); {api.used_by} passes them"
        )


def test_uvicorn_config_load_sets_the_lifespan_class() -> None:
    """``Config.lifespan_class`` is an attribute ``Config.load()`` sets (router/http/server.py
    builds the server's lifespan from it)."""
    import uvicorn

    async def app(scope, receive, send):  # pragma: no cover - never called
        raise AssertionError

    config = uvicorn.Config(app, lifespan="off")
    config.load()
    assert inspect.isclass(config.lifespan_class), "uvicorn.Config.load() no longer sets it"


def test_prometheus_histogram_children_keep_bounds_buckets_and_sum() -> None:
    """``router/metrics.py`` (``Observations``) adds a histogram's batched observations
    straight to a child's ``_buckets[i]`` and ``_sum``, picked by ``_upper_bounds``: three
    instance attributes, so checked on an instance."""
    from prometheus_client import Histogram

    histogram = Histogram("private_api_check", "", ["l"], buckets=(1.0, 2.0), registry=None)
    child = histogram.labels("x")
    assert list(child._upper_bounds) == [1.0, 2.0, float("inf")]
    child._buckets[1].inc(2)
    child._sum.inc(3.0)
    (family,) = histogram.collect()
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("private_api_check_bucket", "1.0")] == 0
    assert samples[("private_api_check_bucket", "2.0")] == 2  # cumulative, as exported
    assert samples[("private_api_check_count", None)] == 2
    assert samples[("private_api_check_sum", None)] == 3.0


def test_the_checker_fails_for_a_missing_name() -> None:
    with pytest.raises(AttributeError):
        resolve("uvicorn:Server.no_such_method")
    with pytest.raises(ImportError):
        resolve("ray._private.no_such_module:x")
