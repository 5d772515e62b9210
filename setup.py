"""perseus-ext: remove energy bloat from pipeline-parallel training on DeepSpeed and Megatron."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

AUTOLOAD_PTH = "perseus_ext_autoload.pth"


class BuildWithAutoload(build_py):
    """Also put the `.pth` hook at the top of site-packages: it hooks DeepSpeed on import, so a
    `"perseus"` key in the DeepSpeed config is all a job needs (PERSEUS_AUTOLOAD=0 opts out)."""

    def run(self) -> None:
        super().run()
        # An editable install packs the install directory (the unpacked wheel), not build_lib.
        editable = getattr(self, "editable_mode", False)
        target = self.get_finalized_command("install").install_lib if editable else self.build_lib
        self.copy_file(AUTOLOAD_PTH, str(Path(target) / AUTOLOAD_PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / AUTOLOAD_PTH)]


TORCH = "torch>=2.1"  # install torch==2.13.0 first on CPU machines so pip keeps the CPU build

EXTRAS = {
    "nvml": ["nvidia-ml-py>=12.535"],
    "deepspeed": [TORCH, "deepspeed>=0.14,<0.19"],
    "megatron": [TORCH, "megatron-core>=0.16"],
    "plot": ["matplotlib>=3.7"],
    "reference": ["lowtime==0.3.0"],
    "test": ["pytest>=8", "pytest-timeout>=2.3", "matplotlib>=3.7"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="perseus-ext",
    version="0.1.0",
    description="Energy-bloat removal for pipeline-parallel training (Perseus, Zeus, Chase) "
    "on DeepSpeed and Megatron",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["perseus_ext", "perseus_ext.*"]),
    install_requires=["numpy>=1.24", "scipy>=1.11", "highspy>=1.7", "networkx>=3.0", "tqdm>=4.60"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["perseus-ext = perseus_ext.cli:main"]},
    cmdclass={"build_py": BuildWithAutoload},
)
