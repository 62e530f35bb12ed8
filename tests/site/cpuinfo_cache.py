"""py-cpuinfo's ``get_cpu_info`` answered from one file for every process of a test session (tests/conftest.py
installs it in the pytest processes and puts this directory on the PYTHONPATH of the processes the tests start, whose
``sitecustomize`` installs it there).

DeepSpeed asks py-cpuinfo about the CPU at every CPU Adam it makes and at every op it loads, and py-cpuinfo answers
each time from a new Python process: about 1.1 s of CPU, a third of what a test's two-step training process spends.
The answer is the machine's and does not change during the session: the first process to ask writes it to the file
``DS_PSEUDO_REAL_TEST_CPUINFO`` names (a new one each session), the others read it."""
import importlib.abc
import importlib.util
import json
import os
import sys

CACHE_ENV = "DS_PSEUDO_REAL_TEST_CPUINFO"


def read_once(get_cpu_info, path: str):
    """``get_cpu_info`` answered from ``path``, written by the first call that finds no answer there."""
    def get_cpu_info_from_file():
        try:
            with open(path) as cached:
                return json.load(cached)
        except (OSError, ValueError):
            pass
        info = get_cpu_info()
        part = f"{path}.{os.getpid()}"
        with open(part, "w") as written:
            json.dump(info, written)
        os.replace(part, path)  # whole or absent for a reader
        return info

    get_cpu_info_from_file.uncached = get_cpu_info
    return get_cpu_info_from_file


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``cpuinfo`` is imported, its module gets ``read_once`` once it has run."""

    def __init__(self, path: str):
        self.path = path

    def find_spec(self, name, import_path, target=None):
        if name != "cpuinfo":
            return None
        sys.meta_path.remove(self)  # the module is patched once; the real finders find it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, path = spec.loader.exec_module, self.path

        def exec_and_patch(module):
            exec_module(module)
            module.get_cpu_info = read_once(module.get_cpu_info, path)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """In this process, where ``DS_PSEUDO_REAL_TEST_CPUINFO`` is set: now if cpuinfo is imported, else on its import."""
    path = os.environ.get(CACHE_ENV)
    if not path:
        return
    module = sys.modules.get("cpuinfo")
    if module is not None:
        if not hasattr(module.get_cpu_info, "uncached"):
            module.get_cpu_info = read_once(module.get_cpu_info, path)
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(path))
