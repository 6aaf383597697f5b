"""The transformers releases: the range ``pyproject.toml`` declares is the range CI tests (the
suite on its newest release, the ``compat`` tests on its oldest, both from ``scripts/setup.sh``),
and a release outside it gets a warning that names the range."""

from __future__ import annotations

import re
import warnings

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from test_materialize import ROOT

from pippy_xla import hf_compat


def _declared() -> SpecifierSet:
    (dep,) = re.findall(r'"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text())
    return Requirement(dep).specifier


def _set_up() -> tuple[Version, list[Version]]:
    """The release scripts/setup.sh installs for the suite, and those of the compat pass."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    (main,) = re.findall(r'"transformers==([\d.]+)"', text)
    return Version(main), [Version(v) for v in re.findall(r"^compat ([\d.]+)", text, re.M)]


def test_the_declared_range_is_the_tested_range():
    spec = _declared()
    lower = [Version(s.version) for s in spec if s.operator == ">="]
    upper = [Version(s.version) for s in spec if s.operator == "<"]
    assert len(lower) == len(upper) == 1 and len(spec) == 2, f"want >=oldest,<next: {spec}"
    main, compat = _set_up()
    # The suite runs on the range's newest minor release, the compat tests on its oldest.
    assert main in spec and (main.major, main.minor + 1) == upper[0].release[:2], (main, spec)
    assert compat and min(compat) == lower[0], (compat, spec)
    assert all(v in spec for v in compat), (compat, spec)


@pytest.mark.parametrize("package", ["peft", "trl"])
def test_peft_and_trl_are_declared_up_to_the_release_ci_tests(package):
    """Every requirement of ``package`` in ``pyproject.toml``'s extras admits the release
    ``scripts/setup.sh`` installs, and no later minor release (PEFT 0.22 came out untested)."""
    (pinned,) = re.findall(rf'"{package}==([\d.]+)"', (ROOT / "scripts" / "setup.sh").read_text())
    pinned = Version(pinned)
    found = re.findall(rf'"({package}[<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert found, package
    for dep in found:
        spec = Requirement(dep).specifier
        upper = [Version(s.version) for s in spec if s.operator == "<"]
        assert pinned in spec and upper, (dep, pinned)
        assert upper[0].release[:2] == (pinned.major, pinned.minor + 1), (dep, pinned)


def test_the_installed_metadata_declares_that_range():
    assert hf_compat.tested_releases() == str(_declared())


@pytest.mark.parametrize("version", ["5.26.0", "6.0.0", "5.16.1"])
def test_a_release_outside_the_range_is_allowed_with_a_warning(version):
    hf_compat.warn_if_untested.cache_clear()
    with pytest.warns(UserWarning) as caught:
        assert hf_compat.warn_if_untested(version)
    (w,) = caught
    message = str(w.message)
    assert f"transformers {version} " in message and str(_declared()) in message, message
    assert "\n" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process and release
        assert hf_compat.warn_if_untested(version)


def test_a_tested_release_gets_no_warning():
    hf_compat.warn_if_untested.cache_clear()
    main, compat = _set_up()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version in (main, *compat):
            assert not hf_compat.warn_if_untested(str(version))


def test_the_readme_and_the_docs_state_that_range():
    spec = _declared()
    main, compat = _set_up()
    for page in (ROOT / "README.md", ROOT / "docs" / "testing.md"):
        stated = re.search(r"`pyproject.toml` admits,? \(?`([^`]+)`", page.read_text())
        assert stated and SpecifierSet(stated[1]) == spec, (page.name, stated, spec)
    testing = (ROOT / "docs" / "testing.md").read_text()
    assert f"runs on the newest, {main.major}.{main.minor}" in testing
    oldest = min(compat)
    assert f"on the oldest, {oldest.major}.{oldest.minor}" in testing
