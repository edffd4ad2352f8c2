"""One rank of the engine: its worker, model runner, input buffers, CUDA graphs, KV cache and
sampler. It knows its own model and memory, never the scheduler or other ranks' state."""
