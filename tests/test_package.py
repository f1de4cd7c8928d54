"""The package as users install it: one version, typed, no pinned TensorFlow
distribution, and a page of the API reference for every public name."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jacobkit

ROOT = Path(__file__).resolve().parent.parent
API_DOCS = ROOT / "docs" / "api"
#: public modules documented as a whole: the name users write -> the module
PUBLIC_MODULES = {
    "data": "jacobkit.batches",
    "explain": "jacobkit.explain",
    "layers": "jacobkit.layers",
    "memory": "jacobkit.memory",
    "planner": "jacobkit.planner.Auto",
    "privacy": "jacobkit.privacy",
    "strategies": "jacobkit.strategies",
    "testing": "jacobkit.testing",
}


def test_the_version_has_one_source():
    out = subprocess.run(
        [sys.executable, "-m", "jacobkit", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"jacobkit {jacobkit.__version__}"
    assert importlib.metadata.version("jacobkit") == jacobkit.__version__


def test_no_tensorflow_distribution_is_required_by_name():
    # tensorflow, tensorflow-cpu and tf-nightly all provide the module: a hard
    # requirement on one makes pip install a second next to another
    requires = importlib.metadata.requires("jacobkit") or []
    tensorflow = [r for r in requires if re.match(r"tensorflow\b", r)]
    assert tensorflow, "the tensorflow extras are missing"
    assert all("extra ==" in r for r in tensorflow), tensorflow


def test_without_tensorflow_the_error_names_the_extra():
    # a finder that makes `import tensorflow` fail, as on a machine without it
    code = (
        "import sys\n"
        "class NoTF:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorflow' or name.startswith('tensorflow.'):\n"
        "            raise ModuleNotFoundError(\n"
        "                \"No module named 'tensorflow'\", name='tensorflow')\n"
        "sys.meta_path.insert(0, NoTF())\n"
        "import jacobkit\n"
        "print(jacobkit.__version__)\n"
        "try:\n"
        "    jacobkit.jacobian\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0] == jacobkit.__version__
    assert "jacobkit[tensorflow]" in out


def test_the_package_is_typed():
    assert (Path(jacobkit.__file__).parent / "py.typed").is_file()


def _documented() -> set[str]:
    text = "\n".join(p.read_text() for p in API_DOCS.glob("*.md"))
    return set(re.findall(r"^::: ([\w.]+)", text, flags=re.M))


@pytest.mark.parametrize(
    "name",
    sorted({*jacobkit.__all__, *PUBLIC_MODULES} - {"__version__"}),
)
def test_every_public_name_has_a_page_in_the_api_reference(name):
    target = PUBLIC_MODULES.get(name, f"jacobkit.{name}")
    assert target in _documented(), f"no '::: {target}' in docs/api/"


def test_psutil_is_an_extra_imported_in_one_place():
    """psutil is optional (the ``bench`` extra): no module imports it but the
    one that falls back without it."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"psutil\b", d)]
    assert "psutil" in project["optional-dependencies"]["bench"]
    importers = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "jacobkit").rglob("*.py")
        if re.search(r"^\s*(import|from) psutil\b", path.read_text(), flags=re.M)
    )
    assert importers == ["jacobkit/bench/resident.py"]


def test_resident_memory_without_psutil(monkeypatch, tmp_path):
    """jacobkit compare's process growth without psutil: the resident set
    from /proc/self/statm on Linux; unknown (None, ``n/a`` in the table)
    where that cannot be read either, never an error."""
    from jacobkit.bench import resident

    with_psutil = resident.resident_bytes()
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` fails
    if sys.platform.startswith("linux"):
        without = resident.resident_bytes()
        assert without is not None and without > 0
        if with_psutil is not None:  # both read the same resident set
            assert 0.5 < without / with_psutil < 2
    assert resident.resident_bytes(str(tmp_path / "no-such-file")) is None
    (tmp_path / "statm").write_text("not numbers")
    assert resident.resident_bytes(str(tmp_path / "statm")) is None
