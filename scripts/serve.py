"""The JAX serving script: the same entry point as `surojax serve` (docs/serving.md).

    PYTHONPATH=$PWD python scripts/serve.py MODEL --port 8080 [--api-key KEY] [--enable-lora --lora-modules a=DIR]
"""
import sys

from surojax.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
