"""usp: hybrid Unified Sequence Parallelism (Ulysses x ring) + FSDP2 for long-context Llama training."""

__version__ = "0.1.0"
