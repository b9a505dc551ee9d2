"""Dry run: the whole pipeline on stand-in models with the run's real data sources at tiny sizes
(`python run.py pair=P dry_run=true`; see kvtransfer.dryrun.run)."""
from .run import CANNOT_SHOW, DryRunError, dry_run, shrink
from .standin import STANDIN_NOTE, standin_config, standin_tokenizer, write_standin, write_standins

__all__ = ["CANNOT_SHOW", "DryRunError", "STANDIN_NOTE", "dry_run", "shrink", "standin_config", "standin_tokenizer",
           "write_standin", "write_standins"]
