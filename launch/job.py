"""What the main job will run, read from its config and flags before it builds anything: the sections (the
plugin's, the main job's and DeepSpeed's own), the data and their vocabulary, the model (its family's spec), the
batch and the number of steps; ``--check`` is this alone, in one process.

Owns: those checks, every problem a ConfigError. Must not build a model, an engine or a process group.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.data import BYTE_VOCAB, indexed_vocabulary
from ds_pseudo_real.models.build import ModelSpec, model_spec, parameter_total
from ds_pseudo_real.run_config import RunConfig, check_deepspeed_sections

DEFAULT_STEPS = 600
# Parameters above which the embedded byte corpus (a demo: a few MiB of text) is refused without --allow-demo-corpus
DEMO_CORPUS_MAX_PARAMETERS = 10**9


def batch_shape(config: RunConfig) -> Tuple[int, int]:
    """The micro batch per rank and the gradient accumulation steps (``TrainingFacts``: from any two of
    train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps, by DeepSpeed 0.19.8's rule), and
    DeepSpeed's own sections validated by its config class (``run_config.check_deepspeed_sections``)."""
    micro, gas = config.training.micro_batch, config.training.gradient_accumulation_steps
    check_deepspeed_sections(config.deepspeed, micro, gas)
    return micro, gas


def default_steps(ds_config: Mapping[str, Any]) -> int:
    params = ds_config.get("scheduler", {}).get("params", {})
    return int(params.get("total_num_steps", DEFAULT_STEPS))


@dataclass
class Job:
    """What the job will run, read from the config and the flags, every part validated."""

    config: RunConfig
    steps: int
    vocab: int
    eod: Optional[int]
    spec: ModelSpec
    micro: int
    gas: int

    def describe(self, world: int) -> str:
        ptr = self.config.pseudo_to_real
        switch = ("Pseudo-to-Real off" if not ptr.enabled
                  else f"stages (layers, parameter groups) {ptr.stages(self.spec.num_layers)}")
        return (f"{self.spec.describe()}; data: {self.config.data.describe()}; {self.steps} steps of {self.micro} x "
                f"{self.gas} x {world} sequences; {switch}")


def read_job(args: argparse.Namespace, world: int) -> Job:
    """Everything the job checks before it builds anything, for ``world`` ranks: the sections of the config (the
    plugin's, the main job's and DeepSpeed's own), the data files and their vocabulary, the model and the batch.
    Every problem is a ConfigError; the same code runs in every rank and in ``--check``."""
    config = RunConfig.load(args.deepspeed_config, world_size=world)
    data, ptr = config.data, config.pseudo_to_real
    vocab, eod = (BYTE_VOCAB, None) if data.type == "byte_corpus" else indexed_vocabulary(data)
    flags = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head, "seq_len": args.seq_len}
    spec = model_spec(config, flags, vocab_size=vocab, eod=eod)
    if ptr.enabled:
        ptr.stages(spec.num_layers)  # a progressive schedule's stages, checked before the model is built
        if "layers" in ptr.model_fields_set and ptr.layers != spec.layers:
            raise ConfigError(f"pseudo_to_real.layers: got {ptr.layers!r}; the main job's {spec.kind} model has its "
                              f"layer list at {spec.layers!r}: give that, or leave the key out")
    if config.granular_offload is not None:  # what building the engine refuses, refused before any rank builds
        from ds_pseudo_real.ds_state import check_versions
        from ds_pseudo_real.offload import adam_arguments
        from ds_pseudo_real.offload.config import training_setup

        check_versions("granular_offload")
        adam_arguments(config.deepspeed)
        training_setup(config.granular_offload, config.training, spec.num_layers)
    if data.type == "byte_corpus" and not args.allow_demo_corpus:
        total = parameter_total(spec)
        if total > DEMO_CORPUS_MAX_PARAMETERS:
            raise ConfigError(f"data: the job would train this {spec.kind} model of {total:.3g} parameters on the "
                              f"embedded byte corpus (the data without a \"data\" section), a demo of a few MiB of "
                              f"text; give your dataset in a \"data\" section (docs/data.md), or --allow-demo-corpus "
                              f"to train on the demo corpus anyway")
    micro, gas = batch_shape(config)
    return Job(config, args.steps or default_steps(config.deepspeed), vocab, eod, spec, micro, gas)


def check(args: argparse.Namespace) -> int:
    """``--check``: the job's start-up validation for ``--world-size`` ranks, in this process alone."""
    job = read_job(args, args.world_size)
    print(f"ok: {args.deepspeed_config} on {args.world_size} ranks: {job.describe(args.world_size)}", flush=True)
    return 0
