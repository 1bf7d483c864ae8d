"""The engine of one model replica: requests, scheduler, block manager, KV cache, model
runner, sampler and the step loop (`LLMEngine`), and the offline `LLM` front end.

May import: `workers.models`, `workers.protocol`, `workers.text`, `kernels`, `kvtransfer`
(KV layout) and torch; never `workers.parallel` or `workers.serving`, which drive it.
"""
