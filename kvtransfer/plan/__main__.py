"""python -m kvtransfer.plan: see kvtransfer/plan/cli.py."""
import sys

from .cli import main

sys.exit(main())
