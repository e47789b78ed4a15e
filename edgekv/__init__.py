"""edgekv: long-context LLM inference on edge devices with the KV cache on disk."""
__version__ = "0.1.0"
