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
import copy
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

import ds_pseudo_real
from ds_pseudo_real import logs
from ds_pseudo_real.checkpoint import CheckpointError, claim
from ds_pseudo_real.child_processes import end_children_with_this_process
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.data import BYTE_VOCAB, build_corpus, indexed_vocabulary
from ds_pseudo_real.device import use_collective_timeout, use_rank_device
from ds_pseudo_real.ds_state import MONITOR_SECTIONS, total_parameter_numel
from ds_pseudo_real.ds_state.op_builds import StaleBuildLock, announce_op_builds, skip_inference_all_reduce_op
from ds_pseudo_real.models.build import ModelSpec, build_model, model_spec, parameter_groups, parameter_total
from ds_pseudo_real.ports import PortInUse, explain_port_in_use
from ds_pseudo_real.report import MetricsLog, plot_history, read_records
from ds_pseudo_real.run_config import RunConfig, check_deepspeed_sections
from launch.launcher_watch import watch_launcher

DEFAULT_STEPS = 600
# Parameters above which the embedded byte corpus (a demo: a few MiB of text) is refused without --allow-demo-corpus
DEMO_CORPUS_MAX_PARAMETERS = 10**9
say = logs.job_logger.info  # the job's own lines, from rank 0 (every rank with --log-all-ranks)
warn = logs.logger.warning  # the plugin's warnings, from every rank


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


class StopOnSignal:
    """Turns SIGUSR1/SIGTERM into a flag checked at step boundaries (all ranks agree through an all-reduce); a rank
    whose launcher is gone (killed by a signal it does not pass on) sends itself SIGTERM."""

    def __init__(self):
        self.received: Optional[str] = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)
        watch_launcher()

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name


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


def sum_over_ranks(values: List[torch.Tensor], device: torch.device) -> List[float]:
    """Each of the scalars ``values`` summed over the ranks, in one all-reduce of a tensor on ``device`` (the
    engine's: NCCL takes device tensors only)."""
    total = torch.stack([v.detach().float().reshape(()).to(device) for v in values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.tolist()


@torch.no_grad()
def evaluate(engine, corpus, args, batch_size: int, seq_len: int, rank: int, world: int) -> float:
    engine.eval()
    total = torch.zeros((), device=engine.device)
    for i in range(args.eval_batches):
        x, y = corpus.batch("val", batch_size, seq_len, seed=1234, step=i, rank=rank)
        total += engine(x.to(engine.device), y.to(engine.device)).float()
    engine.train()
    return sum_over_ranks([total], engine.device)[0] / (args.eval_batches * world)


def switch_step(engine) -> Optional[int]:
    """The step the next transition is planned at, while it is ahead (a step trigger only: tokens and plateaus are
    not known)."""
    trigger = engine.next_trigger
    return None if trigger is None else trigger.at_step


def progress(done: int, start: int, steps: int, switch: Optional[int], run_start: float) -> str:
    """ETA from this run's mean step time so far, and the time to the switch when one is planned."""
    per_step = (time.perf_counter() - run_start) / max(done - start, 1)
    text = f"eta {format_seconds(per_step * (steps - done))}"
    if switch is not None and switch > done:
        text += f" | switch in {switch - done} steps (~{format_seconds(per_step * (switch - done))})"
    return text


def format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def default_monitor_paths(ds_config: Mapping[str, Any], out: Path) -> Tuple[Dict[str, Any], List[str]]:
    """DeepSpeed's monitors enabled in the config, and the config with tensorboard and csv_monitor writing under the
    run folder where their section gives no ``output_path``."""
    ds_config, enabled = copy.deepcopy(dict(ds_config)), []
    for name in MONITOR_SECTIONS:
        section = ds_config.get(name)
        if isinstance(section, dict) and section.get("enabled"):
            enabled.append(name)
            if name in ("tensorboard", "csv_monitor") and not section.get("output_path"):
                section["output_path"] = str(out / name)
    return ds_config, enabled


def write_monitor(engine, events: dict, step: int, tokens_per_step: int) -> None:
    """The main job's scalars through DeepSpeed's own monitor (rank 0; DeepSpeed 0.19.8 logs the LR itself), against
    samples like DeepSpeed's own ``Train/Samples/*`` events."""
    monitor = engine.monitor
    if not monitor.enabled or dist.get_rank() != 0:
        return
    samples = engine.global_samples
    monitor.write_events([(f"Train/Samples/{name}", value, samples) for name, value in events.items()]
                         + [("Train/Samples/tokens", step * tokens_per_step, samples)])


def warn_on_failed_save(action, rank: int) -> None:
    """Run ``action``, which may save or finish a checkpoint (``engine.step`` finishes one written in the background):
    its CheckpointError, raised on every rank, is a warning from rank 0, and training goes on (the next save tries
    again; the last good checkpoint is named)."""
    try:
        action()
    except CheckpointError as error:
        if rank == 0:
            warn(str(error))


def save_before_stopping(engine, folder: str, step: int, signal_name: str, rank: int) -> None:
    """On a stop signal: the checkpoint of ``step``, published before the ranks exit. With ``checkpoint.async_save``,
    the checkpoint still being written is finished first, and when it is this very step's (the interval's) it is not
    written again; the time taken is printed, for sizing the grace period before SIGKILL (SLURM's ``--signal-grace``,
    its KillWait after a preemption's SIGTERM). A failure of the stop's own save exits 2."""
    start = time.perf_counter()
    in_flight = engine.checkpoint_in_flight
    if in_flight is not None:
        logs.logger.info(f"stopping on signal {signal_name} at step {step}: waiting for the checkpoint being written "
                         f"in the background, {in_flight}")
        try:
            engine.wait_for_checkpoints()
        except CheckpointError as error:
            if rank == 0:
                warn(str(error))
            in_flight = None
    if in_flight is None or Path(in_flight).name != f"global_step{step}":
        engine.save_checkpoint(folder)
        engine.wait_for_checkpoints()
    print(f"saved checkpoint at step {step} on signal {signal_name} ({time.perf_counter() - start:.2f} s after the "
          f"step ended)", flush=True)


def single_process_defaults() -> None:
    """Started without a launcher (``python launch/train.py``, ``ds-pseudo-real train``): one rank on this host,
    so DeepSpeed does not fall back to MPI discovery."""
    if "RANK" in os.environ:
        return
    from ds_pseudo_real.ports import rendezvous_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(rendezvous_port()))


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
        switch = "Pseudo-to-Real off" if not ptr.enabled else \
            f"stages (layers, parameter groups) {ptr.stages(self.spec.num_layers)}"
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


def train(args: argparse.Namespace) -> int:
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
    config, spec, steps, micro, gas = job.config, job.spec, job.steps, job.micro, job.gas
    out = Path(args.output_dir or Path("runs") / Path(args.deepspeed_config).stem)
    ckpt_dir = out / "checkpoints"
    claim(str(ckpt_dir))  # the configuration is valid: the folder is this run's until it ends (a second run stops here)
    say(f"data: {config.data.describe()}")
    corpus = build_corpus(config.data, seq_len=spec.seq_len, seed=args.seed, train_samples=steps * gas * micro * world,
                          val_samples=args.eval_batches * micro * world, world_size=world,
                          cache_dir=out / "data_cache", vocab_size=job.vocab, eod=job.eod,
                          max_bytes=args.corpus_bytes)
    if hasattr(corpus, "describe"):
        say(corpus.describe())
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
    start_step = engine.global_steps
    seq_len = spec.seq_len
    resolved = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
    if (micro, gas) != resolved:
        raise RuntimeError(f"the data were sized for micro batch {micro} x {gas} accumulation steps; DeepSpeed "
                           f"resolved {resolved[0]} x {resolved[1]}")
    tokens_per_step = micro * gas * seq_len * world
    if start_step >= steps:
        say(finished_already(out, ckpt_dir, start_step, steps))
        print(f"rank {rank} finished at step {engine.global_steps} stage {engine.stage}", flush=True)
        return 0
    log = MetricsLog(out / "metrics.jsonl", resume_step=start_step) if rank == 0 else None
    total = total_parameter_numel(engine.module)  # collective
    say(f"training {steps} steps from step {start_step}: {tokens_per_step} tokens/step, stage {engine.stage}, "
        f"{ds_pseudo_real.parameter_count(engine.module):,} parameters per rank, {total:,} in total, output {out}")
    if rank == 0 and (switch_step(engine) or 0) > steps:
        warn(f"the next delink is planned at step {switch_step(engine)}, after this run's last step {steps} (--steps, "
             f"else scheduler.params.total_num_steps): this run trains only the {engine.stage} model")

    seen_transition = engine.last_transition
    window_start, window_steps = time.perf_counter(), 0
    run_start = time.perf_counter()
    while engine.global_steps < steps:
        step = engine.global_steps
        stage, groups = engine.stage, engine.groups
        loss_sum = torch.zeros((), device=engine.device)
        for m in range(gas):
            x, y = corpus.batch("train", micro, seq_len, args.seed, step * gas + m, rank)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            loss_sum += loss.detach().float()
            warn_on_failed_save(engine.step, rank)  # a checkpoint written in the background may fail here
        # the stop flag rides along: every rank stops at the same step if any rank got the signal
        loss_total, stopping = sum_over_ranks([loss_sum, torch.tensor(float(bool(stopper.received)))], engine.device)
        train_loss = loss_total / (gas * world)
        done = engine.global_steps
        window_steps += 1
        record = {"step": done, "stage": stage, "groups": groups, "train_loss": round(train_loss, 5),
                  "lr": engine.optimizer.param_groups[0]["lr"], "tokens": done * tokens_per_step}
        events = {"train_loss": train_loss, "stage": 0.0 if stage == "pseudo" else 1.0}
        if engine.last_transition is not seen_transition:
            seen_transition = engine.last_transition
            events["delink"] = float(seen_transition["parameters_after_total"])
            if log:
                event = {k: v for k, v in seen_transition.items() if not k.startswith("offload_plan")}
                log.write({"event": "delink", **event})
        if done % args.eval_interval == 0 or done == steps:
            record["val_loss"] = round(evaluate(engine, corpus, args, micro, seq_len, rank, world), 5)
            events["val_loss"] = record["val_loss"]
            engine.report_eval({"val_loss": record["val_loss"]})
        if log:
            log.write(record)
        if done % args.log_interval == 0 or "val_loss" in record or done == steps:
            elapsed = time.perf_counter() - window_start
            rate = window_steps * tokens_per_step / max(elapsed, 1e-9)
            events["tokens_per_s"] = rate
            val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
            say(f"step {done}/{steps} | stage {stage} | loss {train_loss:.4f}{val} | {rate:,.0f} tokens/s | "
                f"lr {record['lr']:.2e} | {progress(done, start_step, steps, switch_step(engine), run_start)}")
            window_start, window_steps = time.perf_counter(), 0
        write_monitor(engine, events, done, tokens_per_step)
        if args.save_interval and done % args.save_interval == 0 and done < steps:
            warn_on_failed_save(lambda: engine.save_checkpoint(str(ckpt_dir)), rank)
        if stopping > 0:
            save_before_stopping(engine, str(ckpt_dir), done, stopper.received or "from another rank", rank)
            return 0

    warn_on_failed_save(engine.wait_for_checkpoints, rank)  # the last interval's, written in the background
    engine.save_checkpoint(str(ckpt_dir))
    engine.wait_for_checkpoints()  # the final checkpoint published, or exit 2
    if rank == 0:
        history = read_records(out / "metrics.jsonl")
        plot = out / "loss.png"
        try:
            plot_history(history, plot, title=Path(args.deepspeed_config).name)
        except OSError as error:  # like a failed log write: the run itself is done and saved
            warn(f"could not write {plot}: {error}")
            plot = None
        say(closing_summary(history, out, ckpt_dir / f"global_step{engine.global_steps}", plot, start_step, steps,
                            tokens_per_step, time.perf_counter() - began))
    print(f"rank {rank} finished at step {engine.global_steps} stage {engine.stage}", flush=True)
    return 0


def stage_spans(history: List[Mapping[str, Any]]) -> List[str]:
    """The run's stages from its history: ``pseudo (1 parameter group) steps 1-150``, each delink between them."""
    spans: List[List[Any]] = []  # [stage, groups, first step, last step]
    delinks = {r["step"]: r for r in history if r.get("event") == "delink"}
    for record in (r for r in history if "train_loss" in r):
        if spans and spans[-1][:2] == [record["stage"], record["groups"]]:
            spans[-1][3] = record["step"]
        else:
            spans.append([record["stage"], record["groups"], record["step"], record["step"]])
    parts = []
    for stage, groups, first, last in spans:
        delink = delinks.get(first - 1)
        if delink is not None:
            parts.append(f"delinked at step {first - 1} in {delink.get('seconds', 0):.2f} s "
                         f"({delink.get('groups_before')} -> {delink.get('groups_after')} parameter groups)")
        plural = "s" if groups != 1 else ""
        parts.append(f"{stage} ({groups} parameter group{plural}) steps {first}-{last}")
    return parts


def closing_summary(history: List[Mapping[str, Any]], out: Path, checkpoint: Path, plot: Optional[Path],
                    start_step: int, steps: int, tokens_per_step: int, seconds: float) -> str:
    """What the run did and where it left it: stages and delinks, steps, tokens, the last losses, the time, the
    checkpoint, metrics and plot, and how to go on."""
    train = [r for r in history if "train_loss" in r]
    val = [r for r in history if "val_loss" in r]
    losses = [f"train {train[-1]['train_loss']:.4f}"] if train else []
    if val:
        losses.append(f"validation {val[-1]['val_loss']:.4f} (step {val[-1]['step']})")
    return "\n".join([
        f"done: step {steps} of {steps}, steps {start_step + 1}-{steps} in this run, {format_seconds(seconds)} in "
        f"all; {steps * tokens_per_step:,} tokens trained on",
        "  stages: " + "; ".join(stage_spans(history) or ["none recorded"]),
        "  final loss: " + (", ".join(losses) or "not recorded"),
        f"  checkpoint: {checkpoint}",
        f"  metrics: {out / 'metrics.jsonl'}" + (f"; plot: {plot}" if plot else ""),
        f"  next: the same command trains on from step {steps} with --steps N (N > {steps}); --no-resume or another "
        f"--output-dir starts over",
    ])


def finished_already(out: Path, ckpt_dir: Path, step: int, steps: int) -> str:
    return (f"{out} has finished already: its checkpoint {ckpt_dir / f'global_step{step}'} is at step {step}, and "
            f"this run is to end at step {steps} (--steps, else scheduler.params.total_num_steps), so there is "
            f"nothing to train. To train on, run the same command with --steps N (N > {step}); to start over, add "
            f"--no-resume or give another --output-dir")


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
