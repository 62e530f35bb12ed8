"""The documentation against the code: every key of the config sections (the plugin's and the main job's model and
data sections) is in docs/configuration.md, every link between the docs resolves, and the READMEs stay short enough
to read."""
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from ds_pseudo_real.config import CheckpointOptions, PlateauTrigger, PseudoToRealConfig, ScheduleStage, SwitchTrigger
from ds_pseudo_real.data import ByteCorpusData, IndexedData
from ds_pseudo_real.models.registry import model_sections
from ds_pseudo_real.offload.config import ActivationEstimate, GranularOffloadConfig, ModelSize

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "configuration.md"

# (model, the dotted prefix its keys have in the JSON)
SECTIONS = [
    (PseudoToRealConfig, "pseudo_to_real"),
    (SwitchTrigger, "pseudo_to_real.switch"),
    (PlateauTrigger, "pseudo_to_real.switch.on_plateau"),
    (CheckpointOptions, "checkpoint"),
    (GranularOffloadConfig, "granular_offload"),
    *((section, kind) for kind, section in model_sections().items()),
    (ByteCorpusData, "data"),
    (IndexedData, "data"),
]
# sub-models documented as one row listing their keys
NESTED = [(ScheduleStage, "pseudo_to_real.schedule"), (ActivationEstimate, "granular_offload.activations"),
          (ModelSize, "granular_offload.model")]


def _rows(text: str):
    return [line for line in text.splitlines() if line.startswith("| `")]


def _documented(rows) -> set:
    """The keys the rows' first cells name (a row may name several: `| `gpt.n_layer`, `gpt.d_model` |`)."""
    return {key for row in rows for key in re.findall(r"`([^`]+)`", row.split("|")[1])}


@pytest.mark.parametrize("model,prefix", SECTIONS, ids=[f"{p}-{m.__name__}" for m, p in SECTIONS])
def test_every_key_of_a_section_has_a_row_in_the_reference(model: type, prefix: str):
    documented = _documented(_rows(REFERENCE.read_text()))
    missing = [key for key in model.model_fields if not any(
        name == f"{prefix}.{key}" or name.startswith(f"{prefix}.{key}.") for name in documented)]
    assert not missing, f"docs/configuration.md has no row for {[f'{prefix}.{k}' for k in missing]}"


@pytest.mark.parametrize("model,prefix", NESTED, ids=[p for _, p in NESTED])
def test_every_key_of_a_nested_section_is_named_in_the_reference(model: type, prefix: str):
    text = REFERENCE.read_text()
    rows = [row for row in _rows(text) if f"`{prefix}" in row]
    assert rows, f"docs/configuration.md has no row for {prefix}"
    missing = [key for key in model.model_fields if not any(f"`{key}`" in row or f".{key}`" in row for row in rows)]
    assert not missing, f"docs/configuration.md does not name {prefix} keys {missing}"


def test_reference_names_no_key_the_sections_do_not_have():
    fields = {}
    for model, prefix in SECTIONS + NESTED:  # data: the keys of either type
        fields.setdefault(prefix, set()).update(model.model_fields)
    unknown = []
    for row in _rows(REFERENCE.read_text()):
        for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+|\[\w\])+)`", row.split("|")[1]):
            parent, _, name = re.sub(r"\[\w\]", "", key).rpartition(".")
            if parent in fields and name not in fields[parent]:
                unknown.append(key)
    assert not unknown, f"docs/configuration.md documents keys no section has: {unknown}"


def _markdown_files():
    return [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path):
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        if not (path.parent / target).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(REPO)} links to missing files {broken}"


@pytest.mark.parametrize("path", [REPO / "README.md", REPO / "benchmarks" / "README.md"],
                         ids=["README.md", "benchmarks/README.md"])
def test_readmes_stay_short(path: Path):
    assert len(path.read_text().splitlines()) <= 250


# Two pytest-xdist workers, a test file (and all the SLURM files together) on one worker: tests/conftest.py
TEST_COMMAND = "pytest -q -n 2 tests"


def test_the_main_readme_shows_the_test_command_ci_runs():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert TEST_COMMAND in readme and TEST_COMMAND in ci.replace("python -m pytest", "pytest")


def test_the_models_table_is_the_registered_families_rows():
    """docs/main-job.md's table of the main job's models, row for row, as each family registers it."""
    from ds_pseudo_real.models.registry import docs_rows

    text = (REPO / "docs" / "main-job.md").read_text()
    table = text[text.index("| section | model |"):].split("\n\n")[0].splitlines()[2:]
    assert table == docs_rows()
