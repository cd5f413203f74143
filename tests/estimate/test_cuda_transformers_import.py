"""The session lets Hugging Face transformers see a batch's real values (so a real run's path,
without the materialised causal mask, is traced) whether ``transformers`` was imported before
the session or is imported by the factory during it. A fresh interpreter is needed: the
order of imports is the point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import torch
from lightning_pilot.estimate import Session

before = "transformers.utils.import_utils" in sys.modules

def build():
    from estimate_models import HFCausalLM  # imports lightning, transformers

    return HFCausalLM("llama")

def trace():
    batch = {{"input_ids": torch.arange(128).reshape(2, 64) % 96}}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["labels"] = batch["input_ids"].clone()
    with Session(factory=build, precision="bf16-mixed", round_to=512, cuda=True) as session:
        phases = session.train_phases(batch, micro_batch=2, seq_len=64)
    return [phases["forward"].peak_bytes, phases["backward"].peak_bytes,
            list(phases["forward"].names)]

first = trace()  # the factory imports transformers inside the session
second = trace()  # transformers imported before this session
print(json.dumps({{"imported_before": before, "first": first, "second": second}}))
"""


def test_a_factory_importing_transformers_traces_as_one_imported_before() -> None:
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(here=here)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["imported_before"] is False
    first, second = found["first"], found["second"]
    assert first[2] == second[2]  # the same operators (no causal mask built in the first)
    assert first[:2] == second[:2]
