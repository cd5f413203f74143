"""Two tiny, real training tasks that make their own data from a seed and train on a CPU in seconds:
:class:`TinyCausalLM` on :class:`InstructionDataModule` and :class:`TinyClassifier` on
:class:`ClassificationDataModule` (docs/demo.md).

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
