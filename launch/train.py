"""The main job: a GPT, the M6 MoE or a Hugging Face causal LM on the embedded byte corpus or Megatron indexed
datasets, pseudo stage -> delink -> real stage.

Started by the deepspeed launcher (``deepspeed launch/train.py --deepspeed_config configs/tiny_cpu.json``),
torchrun, srun, or ``ds-pseudo-real train``. Resumes from the newest checkpoint in ``<output-dir>/checkpoints`` that
verifies (or ``--resume-from``); on SIGUSR1/SIGTERM, or when its launcher is gone, it saves a checkpoint at the next
step boundary and exits 0. Holds ``<output-dir>/checkpoints/run.lock`` while it runs: a second run there stops at once.
``python -m launch.train --check CONFIG --world-size N`` runs its start-up validation alone, before any rank starts.

Rank 0 prints the job's lines (progress, what the delink did, the closing summary) and the plugin's, every rank its
warnings and three lines of its own (started, saved on a signal, finished); ``--log-all-ranks`` shows every rank's.
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import deepspeed
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

import ds_pseudo_real
from ds_pseudo_real import logs
from ds_pseudo_real.checkpointing import CheckpointError, claim
from ds_pseudo_real.checkpointing.policy import CheckpointPolicy
from ds_pseudo_real.child_processes import end_children_with_this_process
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.data import build_corpus
from ds_pseudo_real.device import use_collective_timeout, use_rank_device
from ds_pseudo_real.ds_state import total_parameter_numel
from ds_pseudo_real.ds_state.op_builds import StaleBuildLock, announce_op_builds, skip_inference_all_reduce_op
from ds_pseudo_real.models.build import build_model, parameter_groups
from ds_pseudo_real.ports import PortInUse, explain_port_in_use
from launch.job import DEFAULT_STEPS, DEMO_CORPUS_MAX_PARAMETERS, Job, check, read_job
from launch.run_report import RunReport, default_monitor_paths, finished_already, say
from launch.trainer import StopOnSignal, Trainer


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(parser)
    parser.add_argument("--output-dir", default=None, help="run folder (default: runs/<config name>)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps (default: the scheduler's total_num_steps, else {DEFAULT_STEPS})")
    parser.add_argument("--eval-interval", type=int, default=50, help="steps between validation evaluations")
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    parser.add_argument("--log-interval", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--save-interval", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    parser.add_argument("--no-resume", action="store_true",
                        help="start over from step 0 even if checkpoints exist (the only way to ignore them)")
    parser.add_argument("--resume-from", default=None, metavar="TAG|PATH",
                        help="resume from this checkpoint (a tag in <output-dir>/checkpoints, or a checkpoint folder) "
                             "instead of the newest one that verifies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=None, help="GPT layers (default: the gpt section, else 8)")
    parser.add_argument("--d-model", type=int, default=None, help="GPT width (default: the gpt section, else 128)")
    parser.add_argument("--n-head", type=int, default=None, help="GPT heads (default: the gpt section, else 4)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length (default: the model section's, else 128)")
    parser.add_argument("--corpus-bytes", type=int, default=None,
                        help="bytes of training text the byte corpus loads (default: data.max_bytes, else 8 MiB)")
    parser.add_argument("--check", default=None, metavar="CONFIG",
                        help="validate CONFIG with the model and run flags given as the job does at start, for "
                             "--world-size ranks, without starting a rank or building anything; print one line and "
                             "exit 0, or the error and exit 2")
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                        help="with --check: the ranks the job will run on (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--allow-demo-corpus", action="store_true",
                        help=f"train a model of more than {DEMO_CORPUS_MAX_PARAMETERS:.0e} parameters on the embedded "
                             f"byte corpus (a demo of a few MiB of text), which is refused otherwise")
    parser.add_argument("--log-all-ranks", action="store_true",
                        help=f"every rank prints its lines, not only rank 0 (the same as {logs.ALL_RANKS_ENV}=1)")
    args = parser.parse_args(argv)
    if args.log_all_ranks:
        logs.log_all_ranks()
    if args.check:
        if args.deepspeed_config and args.deepspeed_config != args.check:
            parser.error(f"--check {args.check} and --deepspeed_config {args.deepspeed_config}: give the config once")
        args.deepspeed_config = args.check
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (e.g. configs/tiny_cpu.json)")
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.no_resume and args.resume_from:
        parser.error("--no-resume and --resume-from contradict each other: give one")
    for flag in ("steps", "eval_interval", "eval_batches", "log_interval", "n_layer", "d_model", "n_head", "seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return args


def single_process_defaults() -> None:
    """Started without a launcher (``python launch/train.py``, ``ds-pseudo-real train``): one rank on this host,
    so DeepSpeed does not fall back to MPI discovery."""
    if "RANK" in os.environ:
        return
    from ds_pseudo_real.ports import rendezvous_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(rendezvous_port()))


def start_distributed() -> None:
    """``deepspeed.init_distributed``, saying what it builds (DeepSpeed's C++ ops: once, where they are cached)
    without building the shared-memory op that only inference uses; a rendezvous port another job holds is one
    error naming the port and the flag that changes it."""
    announce_op_builds()
    skip_inference_all_reduce_op()
    try:
        deepspeed.init_distributed()
    except RuntimeError as error:  # torch's DistNetworkError, when the TCP store cannot listen on MASTER_PORT
        raise explain_port_in_use(error) from None


def load_corpus(job: Job, args: argparse.Namespace, out: Path, world: int):
    """The job's data, sized for its steps and evaluations on ``world`` ranks (indexed datasets cache their sample
    order under ``out``)."""
    config, spec = job.config, job.spec
    say(f"data: {config.data.describe()}")
    corpus = build_corpus(config.data, seq_len=spec.seq_len, seed=args.seed,
                          train_samples=job.steps * job.gas * job.micro * world,
                          val_samples=args.eval_batches * job.micro * world, world_size=world,
                          cache_dir=out / "data_cache", vocab_size=job.vocab, eod=job.eod, max_bytes=args.corpus_bytes)
    if hasattr(corpus, "describe"):
        say(corpus.describe())
    return corpus


def start_engine(job: Job, args: argparse.Namespace, out: Path, ckpt_dir: Path):
    """The model of the job's family through ``ds_pseudo_real.initialize``, DeepSpeed's monitors writing under
    ``out``, resumed from ``ckpt_dir`` unless ``--no-resume``."""
    config, spec = job.config, job.spec
    ptr = config.pseudo_to_real
    if "layers" not in ptr.model_fields_set:  # where the model built from the spec has its layer list
        ptr = ptr.model_copy(update={"layers": spec.layers})
    ds_config, monitors = default_monitor_paths(config.deepspeed, out)
    config = replace(config, deepspeed=ds_config, pseudo_to_real=ptr)
    say(f"model: {spec.describe()}; DeepSpeed monitors: {', '.join(monitors) or 'none'}")
    model = build_model(spec, seed=args.seed)
    engine, _, _, _ = ds_pseudo_real.initialize(model=model, config=config, model_parameters=parameter_groups(spec))
    if not args.no_resume:
        engine.load_checkpoint(str(ckpt_dir), tag=args.resume_from)  # rewinds the monitors to where it resumes
    else:
        engine.rewind_monitors()
    resolved = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
    if (job.micro, job.gas) != resolved:
        raise RuntimeError(f"the data were sized for micro batch {job.micro} x {job.gas} accumulation steps; "
                           f"DeepSpeed resolved {resolved[0]} x {resolved[1]}")
    return engine


def train(args: argparse.Namespace) -> int:
    """The main job on this rank: the process set up, the job read, the run folder claimed, the data, the engine
    (resumed), the trainer's loop, the final checkpoint and the closing summary."""
    began = time.perf_counter()
    stopper = StopOnSignal()  # first: a preemption during start-up must not kill the rank without a checkpoint
    end_children_with_this_process()  # whatever this rank starts (data workers, writers) ends with it
    single_process_defaults()
    use_rank_device()  # NCCL's communicator and every object collective use the current device
    use_collective_timeout()  # DEEPSPEED_TIMEOUT for DeepSpeed's own groups too, not only for the world group
    logs.quiet_libraries()
    start_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} started on {os.uname().nodename}", flush=True)
    job = read_job(args, world)
    out = Path(args.output_dir or Path("runs") / Path(args.deepspeed_config).stem)
    ckpt_dir = out / "checkpoints"
    claim(str(ckpt_dir))  # the configuration is valid: the folder is this run's until it ends (a second run stops here)
    corpus = load_corpus(job, args, out, world)
    engine = start_engine(job, args, out, ckpt_dir)
    start_step = engine.global_steps
    if start_step >= job.steps:
        say(finished_already(out, ckpt_dir, start_step, job.steps))
    else:
        tokens_per_step = job.micro * job.gas * job.spec.seq_len * world
        report = RunReport(engine, out, job.steps, start_step, tokens_per_step, args.log_interval, rank)
        report.starting(total_parameter_numel(engine.module))  # collective
        checkpoints = CheckpointPolicy(engine, ckpt_dir, args.save_interval, rank)
        if Trainer(engine, corpus, job, args, checkpoints, report, stopper, rank, world).run() is not None:
            return 0  # stopped by a signal, its checkpoint saved
        report.closing(checkpoints.at_end(), Path(args.deepspeed_config).name, time.perf_counter() - began)
    print(f"rank {rank} finished at step {engine.global_steps} stage {engine.stage}", flush=True)
    return 0


@record  # torch elastic: an exception that ends a rank goes into torchrun's failure summary as its root cause
def main(argv: Optional[List[str]] = None) -> int:
    """``train`` (or ``check``), with the plugin's errors as one message from rank 0 (every rank stops with exit
    status 2; under torchrun the error is also its failure summary's root cause).

    The process group is destroyed before returning, however ``train`` ends: left to the interpreter's teardown,
    gloo's worker threads can free tensors after Python has gone and abort a rank (SIGABRT) whose run passed."""
    try:
        args = parse_args(argv)
        return check(args) if args.check else train(args)
    except (CheckpointError, ConfigError, PortInUse, StaleBuildLock) as error:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        get_error_handler().record_exception(error)  # into $TORCHELASTIC_ERROR_FILE when torchrun set it
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_without_teardown(status: int) -> None:
    """Leave with ``status`` once the exit handlers (DeepSpeed monitors' flushes, wandb) have run, skipping the
    interpreter's teardown: a C++ thread still joinable there (gloo's or DeepSpeed's) aborts a rank whose run passed
    (``terminate called without an active exception``, SIGABRT), and the batch system marks the job failed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    status = main()
    exit_without_teardown(0 if status is None else status)  # None: --help (torch elastic's @record returns it)
