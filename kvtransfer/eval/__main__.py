"""`python -m kvtransfer.eval --model kvtransfer --model_args source=...,target=...,mapper=...,mode=transfer
--tasks arc_challenge ...`: lm-eval's own CLI with the `kvtransfer` model registered.

One extra flag, `--kv_data_dir DIR`, makes the paper tasks read DIR's local JSONL files (it writes
override YAMLs and passes them as `--include_path`); every other argument is lm-eval's, unchanged.
"""
from __future__ import annotations

import sys
import tempfile


def main(argv: list[str] | None = None) -> None:
    """Register the model, handle --kv_data_dir, then run lm-eval's CLI on the remaining args."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import kvtransfer.eval  # noqa: F401  (registers "kvtransfer")
    from kvtransfer.eval.tasks import write_task_yamls

    if "--kv_data_dir" in argv:
        i = argv.index("--kv_data_dir")
        if i + 1 >= len(argv):
            raise SystemExit("--kv_data_dir needs a directory")
        data_dir = argv[i + 1]
        del argv[i:i + 2]
        if "--include_path" in argv:
            raise SystemExit("--kv_data_dir writes its own --include_path; drop one of them")
        out = write_task_yamls(tempfile.mkdtemp(prefix="kvtransfer_tasks_"), data_dir)
        argv += ["--include_path", str(out)]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
