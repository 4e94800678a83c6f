"""`python -m meshserve.services.bench_serve [FLAGS]`, the same as `meshserve bench serve`."""

import sys

from meshserve.services.bench_serve.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
