"""python -m kvtransfer.bench: see kvtransfer.bench.cli."""
from .cli import main

main()
