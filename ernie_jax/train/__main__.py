"""python -m ernie_jax.train: see ernie_jax/train/run.py."""

import sys

from ernie_jax.train.run import main

sys.exit(main())
