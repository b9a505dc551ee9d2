"""The runner: a configured run's stages (calibrate -> fit -> eval -> bench -> report) over the core,
with every artifact cached under a key of the config that produced it.

    pipeline.py     `execute` (the stages in order, the resource plan checked first, summary.json)
                    and `Run` (models loaded once; moments, R², mapper, fidelity cached by key)
    keys.py         `artifact_key`, shared by the pipeline and the stages below
    eval_stage.py   the eval stage: benchmarks, prefix-conditioned PPL, CoQA drift, per mode (kvtransfer.eval)
    bench_stage.py  the bench stage: mapper vs re-prefill on the run's models or shapes only (kvtransfer.bench)

The runner is the only part that joins the core with eval, bench, plan and report; none of them
imports it. run.py (Hydra) resolves the config into the plain dict `execute` takes.
"""
from .keys import artifact_key
from .pipeline import STAGES, Run, execute, parse_stages

__all__ = ["Run", "execute", "parse_stages", "STAGES", "artifact_key"]
