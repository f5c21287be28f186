"""Worker side: the model runner, its KV cache tensors and the sampler."""
