"""The embedded corpus's file list: the standard library's own sources, not the packages installed beside them."""
from pathlib import Path

import pytest

from ds_pseudo_real.data import stdlib_source_files

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops


def test_the_file_list_skips_installed_packages_and_is_ordered_by_relative_path(tmp_path):
    for name in ("zeta.py", "alpha/b.py", "alpha/a.py", "alpha/notes.txt", "site-packages/numpy/x.py",
                 "alpha/dist-packages/y.py", "lib2to3/fixes/fix_z.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    files = stdlib_source_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == [
        "alpha/a.py", "alpha/b.py", "lib2to3/fixes/fix_z.py", "zeta.py"]
    assert all(isinstance(p, Path) and p.is_absolute() for p in files)
