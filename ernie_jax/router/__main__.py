"""`python -m ernie_jax.router --prefill URL... --decode URL... [--mixed URL...]` (router/app.py)."""

import sys

from ernie_jax.router.app import main

if __name__ == "__main__":
    sys.exit(main())
