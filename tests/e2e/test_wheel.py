"""The wheel as users install it: built from a copy of the checkout with the venv's
setuptools (no build isolation, so no network), then read as a zip."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator

import pytest

from tests.unit.test_packaging import ROOT, setuptools_config

# What a build must not see: local environments, caches and earlier builds
# (a stale build/lib would put removed modules back into the wheel).
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
                                     ".hypothesis", ".taskledger", "mutants", "results", "artifacts")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=NOT_SOURCES)
    out = tmp / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "Package would be ignored" not in build.stdout + build.stderr
    [path] = out.glob("taskledger-*.whl")
    with zipfile.ZipFile(path) as z:
        yield z


def test_the_wheel_holds_only_taskledger_and_its_dist_info(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and dist_info.pop().startswith("taskledger-")
    assert tops - {t for t in tops if t.endswith(".dist-info")} == {"taskledger"}


def test_every_listed_package_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for package in setuptools_config()["packages"]:
        assert package.replace(".", "/") + "/__init__.py" in names, package


def test_the_migrations_and_the_dashboard_files_are_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    migrations = sorted((ROOT / "sql").glob("*.sql"))
    static = sorted(p for p in (ROOT / "service" / "http" / "static").iterdir() if p.is_file())
    assert migrations and static
    for p in migrations:
        assert f"taskledger/sql/{p.name}" in names
    for p in static:
        assert f"taskledger/service/http/static/{p.name}" in names
        assert wheel.read(f"taskledger/service/http/static/{p.name}") == p.read_bytes()


def test_the_console_script_is_taskledger_service_cli_main(wheel: zipfile.ZipFile) -> None:
    [entry_points] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {"taskledger": "taskledger.service.cli.main:main"}
