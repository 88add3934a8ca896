"""What the model is: loading and the model registry, dtype, LoRA adapters, weight refits (disk, tensors, shared memory, distributed) and memory release."""
