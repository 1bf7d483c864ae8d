"""The model runtime: models, paged KV cache, scheduler, sampler and the engine loop.

Public names are imported on first use, so light users of this package (the
block manager's tests, the CLI's make-model, config parsing) don't load the
model code.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "workers.engine.llm",
    "LLMEngine": "workers.engine.llm_engine",
    "EngineConfig": "workers.engine.config",
    "SamplingParams": "workers.protocol.sampling_params",
    "StructuredOutput": "workers.protocol.structured_output",
    "CompletionOutput": "workers.engine.outputs",
    "StreamDelta": "workers.engine.outputs",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
