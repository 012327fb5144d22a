"""Digits classification: the run ``hookfit demo`` makes, as a script to copy and change.

    python examples/digits.py [--epochs N]

The data is scikit-learn's 8x8 digits, shipped inside scikit-learn: nothing is downloaded.
"""

import argparse

from hookfit.tools import demo

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    state = demo.main(epochs=parser.parse_args().epochs)
    raise SystemExit(0 if state.status == "completed" else 1)
