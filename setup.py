"""Ships the repository's conf/ (the Hydra configs) inside the wheel as kvtransfer/conf, so that an installed
`kvtransfer-run` / `kvtransfer-plan` finds them (kvtransfer.config.paths.conf_dir). Everything else is in
pyproject.toml. An editable install needs no copy: it reads conf/ of the checkout."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithConf(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "kvtransfer" / "conf"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(HERE / "conf", target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithConf})
