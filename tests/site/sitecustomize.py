"""Run by Python at the start of every process a test starts (tests/conftest.py puts this directory on its
PYTHONPATH): py-cpuinfo answered from the session's file (cpuinfo_cache)."""
import cpuinfo_cache

cpuinfo_cache.install()
