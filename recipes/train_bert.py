"""Train BERT (Hugging Face BertForMaskedLM) on the Python standard library's source, masked-LM.

    python recipes/train_bert.py                         # defaults: conf/train_bert.yaml
    python recipes/train_bert.py --plan-only cluster=mixed_rack   # plan only, no processes
    python recipes/train_bert.py --help
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("train_bert"))
