import sys

from ernie_jax.serve.cli import main

sys.exit(main())
