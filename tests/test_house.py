"""The house as a contributor finds it: each tool's settings in one file, and links that lead somewhere.

- mypy's settings live in setup.cfg and nowhere else: pyproject.toml has no ``[tool.mypy]`` (mypy
  would read it before setup.cfg), there is no mypy.ini, and mypy's own config reader, started
  from the root as ``scripts/check.sh`` starts it, picks setup.cfg and reads the settings
  (``files = neuron_ckpt``, ``check_untyped_defs``, the modules without type information).
- Every relative link in README.md, CONTRIBUTING.md and docs/*.md names a file or folder that exists.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
from mypy.config_parser import parse_config_file
from mypy.options import Options

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_mypy_settings_live_in_setup_cfg_only():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert not re.search(r"^\[+tool\.mypy", pyproject, re.M), "pyproject.toml has [tool.mypy]: mypy would read it first"
    assert not (ROOT / "mypy.ini").exists() and not (ROOT / ".mypy.ini").exists()
    setup_cfg = configparser.ConfigParser()
    setup_cfg.read(ROOT / "setup.cfg")
    assert setup_cfg["mypy"]["files"] == "neuron_ckpt"
    assert [s for s in setup_cfg.sections() if not s.startswith("mypy")] == [], "setup.cfg holds mypy's settings only"


def test_mypy_reads_setup_cfg_from_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MYPY_CONFIG_FILE_DIR", "")  # parse_config_file sets it; restored after the test
    options = Options()
    parse_config_file(options, lambda: None, None)
    assert Path(options.config_file).resolve() == ROOT / "setup.cfg"
    assert options.files == ["neuron_ckpt"] and options.python_version == (3, 10)
    assert options.check_untyped_defs and options.warn_unused_ignores and options.warn_redundant_casts
    for module in ("torch_xla", "torch_xla.*", "datasets.*", "pyarrow"):
        assert options.per_module_options[module]["ignore_missing_imports"] is True, module


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):  # an anchor in the page, or http(s):, mailto:
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)}: links to nothing: {broken}"
