"""usp: hybrid Unified Sequence Parallelism (Ulysses x ring) + FSDP2 for long-context Llama training.

Packages, lowest layer first (a module imports only its own layer or lower ones; tests/test_import_layers.py):
the shared rules (``usp.units``, ``usp.modes``, ``usp.mlp_tiles``, ``usp.longest``, ``usp.host``,
``usp.errors``, ``usp.atomic``, ``usp.tiny``, ``usp.real``) < ``usp.parallel`` < ``usp.attention`` <
``usp.model`` < ``usp.config`` < ``usp.data`` < ``usp.plan`` < ``usp.checkpoint``, ``usp.startup`` <
``usp.eval`` < ``usp.train`` < ``usp.bench``, ``usp.launch``. The README's "Layout of the repository" says
what each holds.
"""

__version__ = "0.1.0"
