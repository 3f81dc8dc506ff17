"""pyproject.toml: the license is an SPDX expression string (PEP 639), not the deprecated TOML table that makes
setuptools print a deprecation banner on every install, and the build requires a setuptools that reads it."""
import re
import tomllib
from pathlib import Path

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())


def test_license_is_an_spdx_string():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in PYPROJECT["project"].get("classifiers", []))  # PEP 639


def test_build_requires_a_setuptools_that_reads_it():
    pin = next(r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", pin).group(1)) >= 77
