"""pyproject.toml and constraints.txt: the license is an SPDX expression string (PEP 639), not the deprecated TOML
table that makes setuptools print a deprecation banner on every install; the build requires a setuptools that reads
it; constraints.txt pins every requirement within its range."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())


def test_license_is_an_spdx_string():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in PYPROJECT["project"].get("classifiers", []))  # PEP 639


def test_build_requires_a_setuptools_that_reads_it():
    pin = next(r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", pin).group(1)) >= 77


def _pins() -> dict[str, str]:
    """constraints.txt as {canonical name: pinned version}; every line a `name==version` pin."""
    pins = {}
    for n, line in enumerate((Path(__file__).resolve().parents[2] / "constraints.txt").read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt:{n}: {line!r} is not a name==version pin"
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_dependency_within_its_range():
    """The install the README's commands make is the tested one: each requirement of the base install and of the
    dev / serve extras is pinned in constraints.txt to a version its range admits (scripts/lock.sh writes it)."""
    pins = _pins()
    extras = PYPROJECT["project"]["optional-dependencies"]
    for spec in PYPROJECT["project"]["dependencies"] + extras["dev"] + extras["serve"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt (run bash scripts/lock.sh)"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req.specifier}"
