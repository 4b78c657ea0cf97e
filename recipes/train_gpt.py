"""Train a GPT (TinyGPT or Hugging Face GPT-2) on the Python stdlib's source (next-byte prediction).

    python recipes/train_gpt.py                         # defaults: conf/train_gpt.yaml
    python recipes/train_gpt.py --plan-only cluster=mixed_rack   # plan only, no processes
    python recipes/train_gpt.py --help
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("train_gpt"))
