"""The runner: a configured run's stages (calibrate -> fit -> eval -> bench -> report) over the core,
with every artifact cached under a key of the config that produced it.

    pipeline.py        `execute`: the stage graph in order, the resource plan and preflight first, summary.json
    run.py             `Run`, the artifact cache: models loaded once, identities and keys, moments, R², mapper
    artifacts.py       what each artifact's key hashes;  keys.py  `artifact_key`
    preflight.py       every data source a run reads resolves, before anything loads
    calibrate_stage.py the calibration moments (under a lock) and the kept train feature rows
    fit_stage.py       source-layer selection and `FITS`, one fit function per map kind; fit_family.py and
                       fit_trained.py: the orchestration of the map families and of mapper=trained
    fidelity.py        the fitted map against the target's own cache on held-out calibration text
    eval_stage.py      benchmarks, prefix-conditioned PPL, CoQA drift, content controls, per mode (kvtransfer.eval)
    bench_stage.py     mapper vs re-prefill on the run's models or shapes only (kvtransfer.bench)
    report_stage.py    what the report computes from the calibration (variance explained vs k)

The runner is the only part that joins the core with eval, bench, plan and report; none of them
imports it. run.py (Hydra) resolves the config into the plain dict `execute` takes.
"""
from .keys import artifact_key
from .pipeline import STAGES, Run, execute, parse_stages

__all__ = ["Run", "execute", "parse_stages", "STAGES", "artifact_key"]
