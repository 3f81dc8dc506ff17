"""`python -m surojax.train --config FILE`: see surojax/cli/train_script.py."""
import sys

from surojax.cli.train_script import main

sys.exit(main())
