"""SGLang-native routes and every control route (SGLang's and vLLM's): generate, control, health, tokenizer, reasoning separation, LoRA, memory, weights, profiling."""
