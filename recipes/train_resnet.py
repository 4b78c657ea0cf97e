"""Train a ResNet (SmallCNN or torchvision) on synthetic, learnable images.

    python recipes/train_resnet.py                         # defaults: conf/train_resnet.yaml
    python recipes/train_resnet.py --plan-only cluster=mixed_rack   # plan only, no processes
    python recipes/train_resnet.py --help
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run_recipe  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_recipe("train_resnet"))
