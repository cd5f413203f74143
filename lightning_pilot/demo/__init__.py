"""Two tiny, real training tasks for trying pilot-run callbacks on a CPU in seconds.

* :mod:`lightning_pilot.demo.lm`: :class:`TinyCausalLM`, a small decoder-only transformer,
  learns ``copy`` / ``reverse`` / ``sort`` instructions from :class:`InstructionDataModule`.
* :mod:`lightning_pilot.demo.classifier`: :class:`TinyClassifier`, an MLP, learns grouped
  Gaussian data from :class:`ClassificationDataModule`, split by group or by example (leaking).

All data is generated from a seed (nothing is downloaded); both data modules can serve
torchdata ``StatefulDataLoader`` instances (``stateful=True``). See docs/demo.md.

Example:
    >>> from lightning_pilot.demo import InstructionDataModule, TinyCausalLM, decode
    >>> datamodule = InstructionDataModule(dataset_size=32, batch_size=2)
    >>> datamodule.setup()
    >>> decode(datamodule.train_dataset[0]["input_ids"]).split()[0]
    '<bos>'
"""

from lightning_pilot.demo.classifier import (
    ClassificationDataModule,
    GroupedClassificationDataset,
    TinyClassifier,
    example_group,
)
from lightning_pilot.demo.lm import (
    BOS_ID,
    COMMANDS,
    EOS_ID,
    ID_TO_TOKEN,
    IGNORE_INDEX,
    PAD_ID,
    SEP_ID,
    SPECIAL_TOKENS,
    SYMBOLS,
    TOKEN_TO_ID,
    VOCAB,
    VOCAB_SIZE,
    InstructionCollator,
    InstructionDataModule,
    InstructionDataset,
    TinyCausalLM,
    decode,
    encode,
)

__all__ = [
    "BOS_ID",
    "COMMANDS",
    "EOS_ID",
    "ID_TO_TOKEN",
    "IGNORE_INDEX",
    "PAD_ID",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "SYMBOLS",
    "TOKEN_TO_ID",
    "VOCAB",
    "VOCAB_SIZE",
    "ClassificationDataModule",
    "GroupedClassificationDataset",
    "InstructionCollator",
    "InstructionDataModule",
    "InstructionDataset",
    "TinyCausalLM",
    "TinyClassifier",
    "decode",
    "encode",
    "example_group",
]
