"""kvtransfer entry point.

    python run.py                                   # tiny embedded pair, end to end, offline
    python run.py pair=qwen3_14b_32b                # a paper pair (HF hub or pair.source.path=...)
    python run.py -m mapper.k=1,2,4,8               # a sweep; rows collected into one table
    python run.py -m ablation=full,no_rerotation,no_rope,no_rope_k1,no_rope_k1_no_ridge
"""
import hydra
from omegaconf import DictConfig, OmegaConf

from kvtransfer.runner import execute


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True)
    summary = execute(plain, plain["out_dir"])
    print(f"[kvtransfer] {summary['pair']}: wrote {plain['out_dir']}/summary.json")
    tasks = summary.get("tasks") or {}
    for task, r in tasks.items():
        ret = r.get("retention")
        print(f"  {task:<16} target {r.get('target')!s:<8} transfer {r.get('transfer')!s:<8} "
              f"retention {'' if ret is None else f'{100 * ret:.1f} %'}")


if __name__ == "__main__":
    main()
