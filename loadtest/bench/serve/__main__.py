"""`python -m meshserve.bench.serve [FLAGS]`, the same as `meshserve bench serve`."""

import sys

from meshserve.bench.serve.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
