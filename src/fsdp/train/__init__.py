"""``fsdp train``'s engine: a GPT or Llama trained with FSDP on local ranks, under torchrun or
under Slurm, optionally with tensor parallelism.

`TrainConfig` holds every setting (the command's options); `run_training` starts the ranks (or
joins torchrun's or Slurm's) and returns rank 0's `TrainSummary`; `train_rank` is what each
rank runs. The training text is a `ByteCorpus` (by default the standard library's sources,
`default_corpus_root`).
"""

from ._data import ByteCorpus, default_corpus_root
from ._train import TrainConfig, TrainSummary, run_training, train_rank

__all__ = [
    "TrainConfig",
    "TrainSummary",
    "run_training",
    "train_rank",
    "ByteCorpus",
    "default_corpus_root",
]
