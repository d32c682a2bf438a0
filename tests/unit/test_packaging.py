"""The distribution's layout stays what the checkout shows: pyproject's package list is
the package folders, and the links in taskledger/ are the mapping setuptools builds.

A package folder missing from `[tool.setuptools] packages` is left out of the wheel
without an error, and the checkout (which imports through the links) would never
notice: these tests are where it shows. tests/e2e/test_wheel.py builds the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Top-level folders that are packages but not part of the distribution.
NOT_DISTRIBUTED = {"bench", "deploy", "tests", "taskledger"}


def setuptools_config() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        config: dict[str, Any] = tomllib.load(f)["tool"]["setuptools"]
    return config


def packages_under(folder: Path, name: str) -> set[str]:
    """`name` and the dotted name of every folder with an __init__.py below `folder`
    (the real folder: links in it are not followed)."""
    found = {name} if (folder / "__init__.py").is_file() else set()
    for child in sorted(folder.iterdir()):
        if child.is_dir() and not child.is_symlink() and child.name != "__pycache__":
            found |= packages_under(child, f"{name}.{child.name}")
    return found


def top_level_package_folders() -> set[str]:
    return {p.name for p in ROOT.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / "__init__.py").is_file()} - NOT_DISTRIBUTED


def test_every_top_level_package_folder_is_mapped_under_taskledger() -> None:
    package_dir = setuptools_config()["package-dir"]
    assert package_dir == {f"taskledger.{name}": name for name in top_level_package_folders()}


def test_the_packages_list_is_exactly_the_package_folders() -> None:
    expected = packages_under(ROOT / "taskledger", "taskledger")
    for dotted, folder in setuptools_config()["package-dir"].items():
        expected |= packages_under(ROOT / folder, dotted)
    listed = setuptools_config()["packages"]
    assert len(listed) == len(set(listed)), "a package is listed twice"
    assert sorted(listed) == sorted(expected)


def test_the_links_in_taskledger_point_at_the_top_level_folders() -> None:
    links = {p.name: p for p in (ROOT / "taskledger").iterdir() if p.is_symlink()}
    assert set(links) == top_level_package_folders()
    for name, link in links.items():
        assert link.readlink() == Path("..") / name
        assert link.resolve() == (ROOT / name).resolve()


def test_package_data_names_files_that_exist() -> None:
    """sql/*.sql and service/http/static/* are package data; a pattern matching
    nothing would ship a wheel without migrations or without the dashboard."""
    package_dir = setuptools_config()["package-dir"]
    for package, patterns in setuptools_config()["package-data"].items():
        top, _, rest = package.removeprefix("taskledger.").partition(".")
        folder = ROOT / package_dir[f"taskledger.{top}"] / Path(*rest.split(".") if rest else ())
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file in {folder}"
