"""Turning checkpoints into model directories tsterm loads, one job per module:

- `gguf`: a llama.cpp GGUF file -> an HF-format directory (`import_gguf`), and checking one it wrote;
- `gguf_reader`: reading a GGUF file's metadata and tensors; `gguf_extent`: how a truncated one is told apart;
- `gguf_arch`: llama.cpp's architecture and tensor names -> HF's, config.json and generation_config.json;
- `kquant`: GGML quantized blocks (Q8_0, Q4_x, K-quants) -> `tsterm_kernels.quant`'s block layout;
- `gguf_tokenizer`: a GGUF vocabulary -> tokenizer.json / tokenizer_config.json;
- `gguf_cli`: `tsterm import-gguf`;
- `shipped`: the models tsterm ships or makes on first use (the default model, `demo:NAME`), by name;
- `demo`: the random demo checkpoints (and their trained BPE tokenizer) the tests and benchmarks build.
"""
