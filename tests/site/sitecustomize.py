"""Run by Python at the start of every process a test starts (tests/conftest.py puts this directory on its
PYTHONPATH): py-cpuinfo answered from the session's file (cpuinfo_cache); with DS_PSEUDO_REAL_TEST_CPU_FP16=1,
DeepSpeed's CPU accelerator reporting fp16 support (cpu_fp16)."""
import cpu_fp16
import cpuinfo_cache

cpuinfo_cache.install()
cpu_fp16.install()
