"""FP8 accuracy report: FP8 weights (weight-only, w8a8) and the FP8 KV cache against the stored weights.

    python benchmarks/fp8_accuracy.py [CHECKPOINT ...] [--tokens 64]

Without arguments it reports on the golden tiny models in tests/golden (random weights, so the numbers
show the numerics, not the quality of a trained model). Metrics per variant: max and mean abs logit error,
top-1 agreement and mean KL(reference || variant) over every position of random token sequences.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ernie_jax import ErnieConfig  # noqa: E402
from ernie_jax.accuracy import fp8_report  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="*")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    golden = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "golden")
    paths = args.checkpoints or [os.path.join(golden, n, "paddle") for n in sorted(os.listdir(golden))
                                 if os.path.isdir(os.path.join(golden, n))]
    print("| checkpoint | variant | max abs | mean abs | top-1 agree | KL |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        cfg = ErnieConfig.from_pretrained(path)
        ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (args.batch, args.tokens)).astype(np.int32)
        for variant, m in fp8_report(path, ids).items():
            name = os.path.basename(os.path.dirname(path.rstrip("/"))) if path.startswith(golden) else path
            print(f"| {name} | {variant} | {m['max_abs']:.3f} | {m['mean_abs']:.4f} | {m['top1_agreement']:.3f} | "
                  f"{m['kl']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
