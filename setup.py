"""Build hook (the rest of the configuration is in pyproject.toml): ``search_spaces/`` is the one source of the
shipped search spaces; a built wheel carries them as ``viasd_tune/spaces/``, copied here at build time. A source
checkout or an editable install has no such copy: ``viasd_tune.search.space`` reads ``search_spaces/`` there."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SPACES = Path(__file__).resolve().parent / "search_spaces"


class BuildPyWithSpaces(build_py):
    def _spaces(self) -> list[tuple[Path, Path]]:
        target = Path(self.build_lib) / "viasd_tune" / "spaces"
        return [(src, target / src.name) for src in sorted(SPACES.glob("*.yaml"))]

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        spaces = self._spaces()
        if not spaces:
            raise SystemExit(f"no search spaces in {SPACES}: the wheel would ship none")
        for src, dst in spaces:
            self.mkpath(str(dst.parent))
            self.copy_file(str(src), str(dst))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if getattr(self, "editable_mode", False) else [str(dst) for _, dst in self._spaces()]
        return super().get_outputs(include_bytecode) + extra


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPyWithSpaces})
