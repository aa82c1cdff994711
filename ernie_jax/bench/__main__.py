import sys

from ernie_jax.bench.cli import main

sys.exit(main())
