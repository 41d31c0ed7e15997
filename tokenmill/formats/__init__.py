"""Model file formats read without the model: GGUF files and their quantized blocks, AWQ checkpoints. Below model/
and quant/, which both read them (and the tokenizer, which reads a GGUF file's vocabulary)."""
