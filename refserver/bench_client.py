"""NVIDIA AIPerf, the benchmark client from PyPI, driven offline against a server (tests and benchmarks).

AIPerf pulls in a dependency tree of its own (transformers, pandas, pydantic versions …), so it lives in a
virtual environment apart from the project's: ``TOKENPROBE_AIPERF`` names its ``aiperf`` executable, else
the one on ``PATH``, else the one ``scripts/install.sh --test`` installs (``.venv-aiperf``). It needs a tokenizer even when it counts tokens from the server's ``usage``
(``--use-server-token-count``): one is built locally in seconds with that environment's ``tokenizers`` and
``transformers``, so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# A word-level vocabulary of the reference server's pseudo-words: AIPerf builds its synthetic prompts from it.
_BUILD_TOKENIZER = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
syllables = "ka lo mi ren tas vu zel or pin dra so que bal nim tor ey fa gul hin".split()
words = [first + second for first in syllables for second in syllables]
tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(sys.argv[1])
"""


# Where scripts/install.sh --test installs AIPerf: a virtual environment of its own (its pins clash with the
# project's), beside the project's .venv.
INSTALLED_AIPERF = Path(__file__).resolve().parents[1] / ".venv-aiperf" / "bin" / "aiperf"


def find_aiperf() -> Path | None:
    named = os.environ.get("TOKENPROBE_AIPERF") or shutil.which("aiperf") or str(INSTALLED_AIPERF)
    return Path(named) if named and Path(named).is_file() else None


@dataclass(frozen=True)
class AiperfRun:
    summary: dict  # profile_export_aiperf.json: per metric {"avg", "p50", "p90", "p99", …, "unit"}
    records: list[dict]  # profile_export.jsonl: one per request, {"metadata", "metrics"}

    def stat(self, metric: str, statistic: str) -> float:
        return float(self.summary[metric][statistic])


def run_aiperf(aiperf: Path, url: str, work: Path, *, model: str, requests: int, concurrency: int,
               input_tokens: int, output_tokens: int, timeout_s: float = 300) -> AiperfRun:
    """``aiperf profile`` of ``requests`` streamed chat completions at ``concurrency``; its exports, read."""
    tokenizer = work / "tokenizer"
    python = aiperf.parent / "python"
    subprocess.run([str(python), "-c", _BUILD_TOKENIZER, str(tokenizer)], check=True, capture_output=True,
                   timeout=120)
    artifacts = work / "aiperf"
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}  # it reads the dir itself
    command = [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
               "--tokenizer", str(tokenizer), "--use-server-token-count", "--request-count", str(requests),
               "--concurrency", str(concurrency), "--synthetic-input-tokens-mean", str(input_tokens),
               "--output-tokens-mean", str(output_tokens), "--artifact-dir", str(artifacts), "--ui-type", "none"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines() if line]
    return AiperfRun(summary, records)
