"""The sizes the worker tests' fixtures (``conftest.py``) are built with."""

VOCAB_SIZE = 384
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
NUM_BLOCKS = 64
