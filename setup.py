"""Build step pyproject.toml cannot express: install `perseus_ext_autoload.pth` at the top of
site-packages (wheel and editable installs alike). It hooks DeepSpeed on import, so a
`"perseus"` key in the DeepSpeed config is all a job needs (PERSEUS_AUTOLOAD=0 opts out).
Everything else about the package is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

AUTOLOAD_PTH = "perseus_ext_autoload.pth"


class BuildWithAutoload(build_py):
    """build_py that also copies the `.pth` file next to the top-level packages."""

    def run(self) -> None:
        super().run()
        # An editable install packs the install directory (the unpacked wheel), not build_lib.
        editable = getattr(self, "editable_mode", False)
        target = self.get_finalized_command("install").install_lib if editable else self.build_lib
        self.copy_file(AUTOLOAD_PTH, str(Path(target) / AUTOLOAD_PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / AUTOLOAD_PTH)]


setup(cmdclass={"build_py": BuildWithAutoload})
