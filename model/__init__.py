"""Llama-family decoder that loads Hugging Face checkpoints. See model/llama.py for the contract."""

from model.config import ModelArgs
from model.llama import Transformer
from model.load import CheckpointReader, from_pretrained, read_args

__all__ = ["ModelArgs", "Transformer", "CheckpointReader", "from_pretrained", "read_args"]
