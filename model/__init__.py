"""Llama-family decoder that loads Hugging Face checkpoints. See model/llama.py for the contract."""

import logging

# bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community" when it is imported on
# CPUs with AVX512-BF16: an optional speed-up package, nothing a user has to act on.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda r: "kernels-community" not in r.getMessage())

from model.config import ModelArgs  # noqa: E402
from model.llama import Transformer  # noqa: E402
from model.load import CheckpointReader, from_pretrained, read_args  # noqa: E402

__all__ = ["ModelArgs", "Transformer", "CheckpointReader", "from_pretrained", "read_args"]
