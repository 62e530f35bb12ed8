"""Granular CPU offloading: a per-layer placement planner (``planner``), its config section (``config``), the
``plan`` command (``cli``) and the ZeRO-compatible optimizer wrapper (``optimizer``)."""
