"""Hugging Face transformers in and out (optional: ``pip install "fsdp[hf]"``; transformers is
imported only when a function needs it).

- In: `load_hf_pretrained` fills a (sharded) model from a ``save_pretrained`` directory, each
  rank reading only its shard (`HFLoadReport`); `build_hf_pretrained` builds that directory's
  model on meta, `build_hf_model` a model from a config (``fsdp train --hf-config``).
- Out: `save_hf_pretrained` gathers a live sharded model and `export_hf` converts a
  fsdp-ckpt checkpoint, both into a ``save_pretrained`` directory (`HFExportReport`).
"""

from ._export import HFExportReport, export_hf, save_hf_pretrained
from ._model import HFModel, build_hf_model, check_hf_spec, parse_hf_spec
from ._pretrained import (
    HFLoadReport,
    build_hf_pretrained,
    check_hf_pretrained,
    load_hf_pretrained,
    load_tokenizer,
    tokenized_corpus,
)

__all__ = [
    "load_hf_pretrained",
    "HFLoadReport",
    "save_hf_pretrained",
    "export_hf",
    "HFExportReport",
    "HFModel",
    "build_hf_model",
    "build_hf_pretrained",
    "parse_hf_spec",
    "check_hf_spec",
    "check_hf_pretrained",
    "load_tokenizer",
    "tokenized_corpus",
]
