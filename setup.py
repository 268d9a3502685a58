"""setuptools' build hook that puts the shaders into the wheel (issue 13, item 4).

The GLSL sources live in ``shaders/`` at the repository root and their compiled SPIR-V
in ``shaders/build/`` (``trio-llm compile-shaders`` writes it; bench/h200.sh carries
that folder to the GPU machine), outside ``src/``. ``[tool.setuptools.package-data]``
can only name files inside a package's folder, so without a copy step a wheel carried
no shader and an installed trio-llm could neither compile nor find a kernel. This
``build_py`` copies ``shaders/*.comp``, ``shaders/*.glsl`` and the ``shaders/build/*.spv``
present at build time into the built package as ``trio_llm/_shaders/`` and
``trio_llm/_shaders/build/``; ``MANIFEST.in`` puts the same files into the sdist, so a
wheel built from the sdist (``python -m build``) carries them too. Editable installs
(``make serve``) copy nothing: they read the repository's ``shaders/`` in place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHADERS = Path(__file__).resolve().parent / "shaders"


class build_py_with_shaders(build_py):  # noqa: N801 (setuptools' command naming)
    def _shader_files(self) -> list[tuple[Path, Path]]:
        dest = Path(self.build_lib) / "trio_llm" / "_shaders"
        sources = sorted([*SHADERS.glob("*.comp"), *SHADERS.glob("*.glsl")])
        spirv = sorted((SHADERS / "build").glob("*.spv"))
        return [(p, dest / p.name) for p in sources] + [(p, dest / "build" / p.name) for p in spirv]

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        dest = Path(self.build_lib) / "trio_llm" / "_shaders"
        # a build/ folder left by an earlier build keeps old files: start from an empty copy
        # so the wheel holds exactly what shaders/ holds now
        shutil.rmtree(dest, ignore_errors=True)
        (dest / "build").mkdir(parents=True)
        for src, out in self._shader_files():
            self.copy_file(str(src), str(out))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:  # type: ignore[override]
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return outputs + [str(out) for _, out in self._shader_files()]


setup(cmdclass={"build_py": build_py_with_shaders})
