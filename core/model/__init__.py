"""The model: a Llama-family decoder, its loaders (safetensors, GGUF), tokenizer and quantize swaps."""
