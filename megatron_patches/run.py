"""The drop-in flag: ``python -m megatron_patches.run pretrain_gpt.py <their flags> --pseudo-to-real-switch-iter N``.

Owns: the extra flags, and the patches that apply them to an unmodified Megatron-LM pretraining script.
Megatron's ``parse_args`` is wrapped to add the flags to every parser it builds after the script's own
``extra_args_provider`` (so ``--help`` lists them, even from the early parse Megatron-LM's pretrain_gpt.py makes
before ``pretrain``, and argparse checks them); ``megatron.training.pretrain`` is wrapped so that its
``model_provider`` builds the shared block while in the pseudo stage and uses expert-prototyping routers.
``megatron.training.training.train_step`` is wrapped to delink at iteration N, in process. A relaunched run
(``--load``) builds the model its checkpoint holds: ``pseudo_stage_at_start`` decides from Megatron's tracker file.
With a real layout other than the command's (``--pseudo-to-real-real-layout``), the run saves at N and runs the
script again in process on that layout (``StageLayout``), after Megatron-LM's ``destroy_global_state``.
Written against Megatron-LM's public training interface (tag core_v0.16.1):
``pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, ...)``,
``megatron.training.arguments.parse_args(extra_args_provider, ignore_unknown_args)`` (also imported by name into
``megatron.training.initialize``),
``setup_model_and_optimizer(model_provider, model_type)``, ``get_args()``, ``train_step(forward_step_func,
data_iterator, model, optimizer, opt_param_scheduler, config, ...)`` called by ``train()`` with the same model list
and optimizer object every iteration, ``args.curr_iteration``, and the checkpoint layout
``<load>/latest_checkpointed_iteration.txt`` (an iteration or ``release``) with ``--ckpt-step``. The ``--save`` folder
is held for the run's life as the main job holds its output folder (``ds_pseudo_real.checkpointing.claim``), and what
the drop-in refuses (its flags, the checkpoint to load, a folder in use) is one ``error:`` line from rank 0, exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import runpy
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ds_pseudo_real.checkpointing import CheckpointError, claim
from ds_pseudo_real.config import OptimizerStatePolicy
from ds_pseudo_real.logs import logger, quiet_libraries
from megatron_patches import stage_copies

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
USAGE = "usage: python -m megatron_patches.run SCRIPT [SCRIPT FLAGS ...] [PSEUDO-TO-REAL / M6 FLAGS ...]"


def add_arguments(parser):
    """The extra flags, in their own group of Megatron's parser; returns the parser (an extra_args_provider)."""
    group = parser.add_argument_group(title="pseudo-to-real and M6 (megatron_patches)")
    group.add_argument("--pseudo-to-real-switch-iter", type=int, default=None,
                       help="Train with shared layers (the pseudo model) until this iteration, then delink them in "
                            "process and go on with the real model. Default: %(default)s (no sharing).")
    group.add_argument("--pseudo-to-real-groups", type=int, default=1,
                       help="Number of sharing groups of consecutive layers in the pseudo model; must divide "
                            "--num-layers. Default: %(default)s (all layers share one set).")
    group.add_argument("--pseudo-to-real-optimizer-state", default=OptimizerStatePolicy.COPY.value,
                       choices=[p.value for p in OptimizerStatePolicy],
                       help="Adam moments of each delinked layer: copy the shared ones, reset them, or scale them "
                            "by 1/layers-per-group (squared for the second moment). Default: %(default)s.")
    group.add_argument("--pseudo-to-real-real-layout", type=parse_layout, default=None, metavar="KEY=N,...",
                       help="Model parallelism of the real stage where it differs from this command's (the pseudo "
                            "stage's): keys " + ", ".join(LAYOUT_KEYS) + ", e.g. tp=2,pp=2. At the switch the pseudo "
                            "model is saved in --save and the run goes on in process on this layout; a relaunch "
                            "from the switch on takes it too. Default: %(default)s (one layout).")
    group.add_argument("--m6-expert-prototypes", type=int, default=None,
                       help="M6 expert prototyping: split --num-experts into this many prototypes, top-1 routing "
                            "in each, outputs summed. Needs --moe-router-topk equal to it and "
                            "--moe-router-load-balancing-type none. Default: %(default)s (Megatron's router).")
    return parser


#: The keys of --pseudo-to-real-real-layout and the Megatron-LM arguments they set (pp, tp, ... are layout sizes;
#: vpp is --num-layers-per-virtual-pipeline-stage; sp is 0 or 1, --sequence-parallel).
LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "vpp": "num_layers_per_virtual_pipeline_stage", "ep": "expert_model_parallel_size",
               "etp": "expert_tensor_parallel_size", "sp": "sequence_parallel"}


def parse_layout(text: str) -> Dict[str, Union[int, bool]]:
    """``tp=2,pp=2`` -> ``{"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}`` (an argparse type:
    argparse reports the ValueError as an invalid --pseudo-to-real-real-layout value)."""
    layout: Dict[str, Union[int, bool]] = {}
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        if key not in LAYOUT_KEYS or not value.isdigit() or key in layout:
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} in {text!r}: expected KEY=N items separated by commas, each key once, keys "
                f"{', '.join(LAYOUT_KEYS)} (sp=0 or sp=1), e.g. tp=2,pp=2")
        if key == "sp":
            if value not in ("0", "1"):
                raise argparse.ArgumentTypeError(f"sp={value} in {text!r}: expected sp=0 or sp=1")
            layout[key] = value == "1"
        elif int(value) < 1:
            raise argparse.ArgumentTypeError(f"{key}={value} in {text!r}: expected a size of at least 1")
        else:
            layout[key] = int(value)
    return {LAYOUT_KEYS[key]: value for key, value in layout.items()}


def format_layout(layout: Dict[str, Union[int, bool]]) -> str:
    """``parse_layout``'s inverse: ``tp=2,pp=2``."""
    return ",".join(f"{key}={int(layout[name])}" for key, name in LAYOUT_KEYS.items() if name in layout)


class DropInError(AssertionError):
    """A flag, or a checkpoint to load, that the drop-in refuses; an AssertionError as Megatron's own validate_args
    raises, which ``main`` prints as one ``error:`` line from rank 0 (every rank exits 2)."""


def check_arguments(args) -> None:
    """Cross-flag checks naming the flags (:class:`DropInError`)."""
    switch = args.pseudo_to_real_switch_iter
    _require(switch is None or switch >= 1, f"--pseudo-to-real-switch-iter must be >= 1, got {switch}")
    groups = args.pseudo_to_real_groups
    _require(groups >= 1 and args.num_layers % groups == 0,
             f"--pseudo-to-real-groups ({groups}) must be >= 1 and divide --num-layers ({args.num_layers})")
    if args.pseudo_to_real_real_layout is not None:
        _require(switch is not None and args.save,
                 f"--pseudo-to-real-real-layout needs --pseudo-to-real-switch-iter and --save (the pseudo model is "
                 f"saved there at the switch); got --pseudo-to-real-switch-iter {switch}, --save {args.save}")
    prototypes = args.m6_expert_prototypes
    if prototypes is not None:
        experts = getattr(args, "num_experts", None)
        _require(experts is not None, "--m6-expert-prototypes needs --num-experts")
        _require(prototypes >= 1 and experts % prototypes == 0,
                 f"--m6-expert-prototypes ({prototypes}) must divide --num-experts ({experts})")
        _require(args.moe_router_topk == prototypes,
                 f"--moe-router-topk ({args.moe_router_topk}) must equal --m6-expert-prototypes ({prototypes})")
        _require(args.moe_router_load_balancing_type == "none",
                 f"--moe-router-load-balancing-type must be none with --m6-expert-prototypes "
                 f"(got {args.moe_router_load_balancing_type}); --moe-aux-loss-coeff weighs the per-prototype loss")
        # M6's experts have no bias (2 x hidden x ffn parameters each). megatron-core 0.16.1's expert MLP with one
        # fails on its own, with or without this flag: under --bias-gelu-fusion (the default) it refuses the
        # gated expert outputs; without it, at tensor x expert parallel size 1, mlp.py adds the bias in place
        # to the output of an autograd Function that returned its input (a view).
        _require(not getattr(args, "add_bias_linear", False),
                 "--m6-expert-prototypes needs --disable-bias-linear (M6's experts carry no bias); got Megatron's "
                 "default, biases on")


def checkpoint_to_load(load: Optional[str], ckpt_step: Optional[int] = None) -> Union[int, str, None]:
    """The iteration of the checkpoint Megatron-LM will load for ``--load``: ``--ckpt-step`` when given, else what
    ``<load>/latest_checkpointed_iteration.txt`` holds (an iteration, or ``"release"``); None when none will load."""
    if load is None:
        return None
    if ckpt_step:  # Megatron tests it the same way: 0 means "not given"
        return ckpt_step
    tracker = os.path.join(load, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as handle:
        text = handle.read().strip()
    if text == RELEASE:
        return RELEASE
    _require(text.isdigit(), f"--load {load}: {TRACKER_FILE} holds {text!r}; expected an iteration or {RELEASE!r}")
    return int(text)


def pseudo_stage_at_start(switch_iter: Optional[int], checkpoint: Union[int, str, None]) -> bool:
    """Whether the run builds the pseudo (shared) model, given the checkpoint it resumes from (see
    ``checkpoint_to_load``).

    A checkpoint saved at iteration k holds the model after k steps, saved before train_step k runs; the delink
    happens at the start of train_step N, so checkpoints up to and including N hold the pseudo model (resumed, it
    delinks at N) and later ones the real model (resumed, no sharing at all).
    """
    if switch_iter is None:
        return False
    if checkpoint is None:
        return True
    _require(checkpoint != RELEASE,
             f"--pseudo-to-real-switch-iter {switch_iter} with a {RELEASE!r} checkpoint in --load: it names no "
             f"iteration, so whether it holds the pseudo or the real model is unknown; pass --ckpt-step, or drop "
             f"the flag to train the real model")
    return checkpoint <= switch_iter


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise DropInError(message)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _chain(first: Optional[Callable], second: Callable) -> Callable:
    def extra_args_provider(parser):
        return second(first(parser) if first is not None else parser)

    return extra_args_provider


def _become(old: object, new: object) -> None:
    """Make ``old`` the object ``new`` is: train() keeps its own reference to the optimizer (and so does the LR
    scheduler), and hands that same object to every train_step."""
    old.__class__ = new.__class__
    old.__dict__ = new.__dict__


# What train() sets on the model's TransformerConfig before its loop; the schedules read them from model[0]'s config.
_TRAIN_HOOKS = ("grad_scale_func", "finalize_model_grads_func", "timers")
_PER_CHUNK_HOOKS = (("no_sync_func", "no_sync"), ("grad_sync_func", "start_grad_sync"),
                    ("param_sync_func", "start_param_sync"))


def _move_train_hooks(config, model: List[torch.nn.Module], optimizer) -> None:
    """Set on the real model's config the hooks train() set on the pseudo one's (``config``), bound to the new
    DDP chunks and optimizer, in the same shape (a list or a single function)."""
    from megatron.core.utils import get_model_config

    for target in {id(config): config, id(get_model_config(model[0])): get_model_config(model[0])}.values():
        for attr in _TRAIN_HOOKS:
            if getattr(config, attr, None) is not None:
                setattr(target, attr, optimizer.scale_loss if attr == "grad_scale_func" else getattr(config, attr))
        for attr, method in _PER_CHUNK_HOOKS:
            current = getattr(config, attr, None)
            if current is not None:
                bound = [getattr(chunk, method) for chunk in model]
                setattr(target, attr, bound if isinstance(current, list) else bound[0])


class StageLayout:
    """The layout this process trains with: the command's, or --pseudo-to-real-real-layout's from the switch on.

    A run on the command's layout with a different real layout stops at the switch iteration once its checkpoint
    is saved (``switched_at``); the next pass of the script in this process, and any relaunch whose checkpoint to
    load is of the switch or later, get the real layout (``apply``, on the parsed arguments before Megatron
    validates them and builds parallel state from them)."""

    def __init__(self):
        self.switched_at: Optional[int] = None  # the switch iteration, once this process saved its checkpoint
        self.switch_due = False  # this pass trains the pseudo model on a layout other than the real one

    def apply(self, args) -> None:
        layout, switch = getattr(args, "pseudo_to_real_real_layout", None), getattr(args, "pseudo_to_real_switch_iter", None)
        self.switch_due = False
        if layout is None or switch is None:
            return
        if self.switched_at is not None:
            args.load, args.ckpt_step = args.save, self.switched_at
        checkpoint = checkpoint_to_load(args.load, getattr(args, "ckpt_step", None))
        if isinstance(checkpoint, int) and checkpoint >= switch:
            for name, value in layout.items():
                setattr(args, name, value)
        else:
            self.switch_due = any(getattr(args, name, None) != value for name, value in layout.items())


class PseudoToRealRun:
    """State of one drop-in run: which stage it is in, and the user's model provider."""

    def __init__(self, training_module, get_args: Callable, model_provider: Callable, model_type,
                 layout: StageLayout):
        self.training = training_module
        self.get_args = get_args
        self.layout = layout
        self.user_model_provider = model_provider
        self.model_type = model_type
        self.pseudo_stage: Optional[bool] = None  # decided on the first build, once the flags are parsed
        self.stopped_for_switch = False  # saved at the switch to go on with the real layout
        self.restore_at_delink: Dict[str, object] = {}  # Megatron-LM arguments the pseudo stage changed
        self.pseudo_chunks: List[torch.nn.Module] = []  # this rank's pseudo chunks (virtual stages) built so far

    def model_provider(self, *args, **kwargs):
        from megatron_patches.moe import use_prototyping_routers
        from megatron_patches.shared_block import shared_parameter_decoder

        run_args = self.get_args()
        if self.pseudo_stage is None:
            check_arguments(run_args)
            if run_args.save:
                claim(run_args.save)
            checkpoint = checkpoint_to_load(run_args.load, getattr(run_args, "ckpt_step", None))
            self.pseudo_stage = pseudo_stage_at_start(run_args.pseudo_to_real_switch_iter, checkpoint)
            switch, last = run_args.pseudo_to_real_switch_iter, run_args.train_iters
            if self.pseudo_stage and last is not None and switch > last and _rank() == 0:
                print(f"[megatron_patches] WARNING: --pseudo-to-real-switch-iter {switch} is beyond --train-iters "
                      f"{last}: this run trains only the pseudo model", file=sys.stderr, flush=True)
        context = shared_parameter_decoder(run_args.pseudo_to_real_groups) if self.pseudo_stage else contextlib.nullcontext()
        with context:
            model = self.user_model_provider(*args, **kwargs)
        if run_args.m6_expert_prototypes is not None:
            use_prototyping_routers(model, run_args.m6_expert_prototypes)
        if self.pseudo_stage:
            self.pseudo_chunks.append(model)
            vp_stage, vp_size = kwargs.get("vp_stage"), run_args.virtual_pipeline_model_parallel_size
            if vp_stage is None or vp_stage == vp_size - 1:  # get_model builds a rank's chunks in order
                stage_copies.connect(self.pseudo_chunks)
                self._save_copies_reshardable(run_args)
                self.pseudo_chunks = []
        return model

    def _save_copies_reshardable(self, run_args) -> None:
        """A set's copies on several stages put each of their parameters in a gradient bucket of its own
        (``stage_copies``); with the distributed optimizer over several data-parallel ranks, a rank's share of a
        small one holds no parameter, which Megatron's default checkpoint format refuses ("empty bucket
        encountered"). The pseudo stage then saves in the fully reshardable format (the pseudo model's state is
        small); the real stage in the one the command asks for."""
        if (run_args.use_distributed_optimizer and stage_copies.holds_copies(self.pseudo_chunks)
                and not run_args.dist_ckpt_optim_fully_reshardable):
            run_args.dist_ckpt_optim_fully_reshardable = True
            self.restore_at_delink["dist_ckpt_optim_fully_reshardable"] = False

    def train_step(self, original: Callable) -> Callable:
        def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, *rest, **kw):
            run_args = self.get_args()
            if self.pseudo_stage and run_args.curr_iteration >= run_args.pseudo_to_real_switch_iter:
                _require(run_args.curr_iteration == run_args.pseudo_to_real_switch_iter,
                         f"the pseudo model reached iteration {run_args.curr_iteration}, past "
                         f"--pseudo-to-real-switch-iter {run_args.pseudo_to_real_switch_iter}: the loaded "
                         f"checkpoint's iteration disagrees with --load's {TRACKER_FILE} or --ckpt-step")
                self.delink(model, optimizer, config)
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                            *rest, **kw)

        return train_step

    def checkpoint_and_decide_exit(self, original: Callable) -> Callable:
        """At the switch, on a layout other than the real one: save (a format dist checkpointing reshards, also for
        the distributed optimizer) and stop, through Megatron's own exit at an iteration."""

        def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration, *rest, **kw):
            run_args = self.get_args()
            if not (self.pseudo_stage and self.layout.switch_due and iteration == run_args.pseudo_to_real_switch_iter):
                return original(model, optimizer, opt_param_scheduler, iteration, *rest, **kw)
            saved = run_args.exit_interval, run_args.dist_ckpt_optim_fully_reshardable
            run_args.exit_interval, run_args.dist_ckpt_optim_fully_reshardable = iteration, True
            try:
                should_exit = original(model, optimizer, opt_param_scheduler, iteration, *rest, **kw)
            finally:
                run_args.exit_interval, run_args.dist_ckpt_optim_fully_reshardable = saved
            self.layout.switched_at, self.stopped_for_switch = iteration, True
            if _rank() == 0:
                print(f"[megatron_patches] iteration {iteration}: pseudo model saved in {run_args.save}; going on "
                      f"with the real layout {format_layout(run_args.pseudo_to_real_real_layout)}", flush=True)
            return should_exit

        return checkpoint_and_decide_exit

    def delink(self, model: List[torch.nn.Module], optimizer, config) -> None:
        from megatron_patches.delink import delink_in_process

        run_args = self.get_args()
        start, before = time.perf_counter(), parameter_numel(model)
        self.pseudo_stage = False
        for name, value in self.restore_at_delink.items():
            setattr(run_args, name, value)

        def build_wrapped():
            # Build the real model and optimizer as the script's set-up does, without loading its checkpoint again.
            saved = {k: getattr(run_args, k, None) for k in ("load", "iteration", "num_floating_point_operations_so_far")}
            run_args.load = None
            try:
                new_model, new_optimizer, _ = self.training.setup_model_and_optimizer(self.model_provider, self.model_type)
            finally:
                for key, value in saved.items():
                    setattr(run_args, key, value)
            return new_model, new_optimizer

        new_model, new_optimizer = delink_in_process(model, optimizer, build_wrapped,
                                                     run_args.pseudo_to_real_optimizer_state)
        model[:] = new_model
        _become(optimizer, new_optimizer)
        _move_train_hooks(config, model, optimizer)
        after = parameter_numel(model)
        totals = total_parameter_numel(before, after)
        logger.info(f"delinked at iteration {run_args.curr_iteration} in {time.perf_counter() - start:.2f}s: "
                    f"parameters per rank {sum(before):,} -> {sum(after):,}, in total {totals[0]:,} -> {totals[1]:,}; "
                    f"optimizer state '{run_args.pseudo_to_real_optimizer_state}'; parameter groups "
                    f"{run_args.pseudo_to_real_groups} -> {run_args.num_layers}")


def parameter_numel(chunks: List[torch.nn.Module]) -> Tuple[int, int]:
    """This rank's (dense, expert) parameter elements in ``chunks``, a set shared by several layers counted once;
    expert parameters are the ones Megatron does not all-reduce over the data-parallel group (``allreduce`` False)."""
    seen, dense, expert = set(), 0, 0
    for chunk in chunks:
        for param in chunk.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                if getattr(param, "allreduce", True):
                    dense += param.numel()
                else:
                    expert += param.numel()
    return dense, expert


def total_parameter_numel(*counts: Tuple[int, int]) -> List[int]:
    """The model's parameter elements over all ranks for each of this rank's ``(dense, expert)`` counts (collective):
    every rank's sum, each dense parameter held by the world / (tensor x pipeline) ranks, each expert parameter by
    the world / (expert tensor x expert x pipeline) ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    world = dist.get_world_size() if dist.is_initialized() else 1
    pipeline = mpu.get_pipeline_model_parallel_world_size()
    dense_copies = world // (mpu.get_tensor_model_parallel_world_size() * pipeline)
    expert_copies = world // (mpu.get_expert_tensor_parallel_world_size() * mpu.get_expert_model_parallel_world_size()
                              * pipeline)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None  # NCCL's
    shares = torch.tensor([[dense / dense_copies, expert / expert_copies] for dense, expert in counts],
                          dtype=torch.float64, device=device)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(shares)
    return [round(value) for value in shares.sum(dim=1).tolist()]


_INSTALLED: List[tuple] = []


def install() -> None:
    """Wrap ``megatron.training.pretrain`` (under both names scripts import it by); undone by ``uninstall``."""
    import megatron.training as training_package
    import megatron.training.training as training_module

    original_pretrain = training_module.pretrain
    signature = inspect.signature(original_pretrain)
    layout = StageLayout()
    scoped = ("train_step", "finalize_model_grads", "checkpoint_and_decide_exit")

    def pretrain(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        run = PseudoToRealRun(training_module, training_package.get_args, bound.arguments["model_provider"],
                              bound.arguments["model_type"], layout)
        bound.arguments["model_provider"] = run.model_provider
        originals = [getattr(training_module, name) for name in scoped]
        training_module.train_step = run.train_step(originals[0])
        training_module.finalize_model_grads = stage_copies.with_copies_reduced(originals[1])
        training_module.checkpoint_and_decide_exit = run.checkpoint_and_decide_exit(originals[2])
        try:
            return original_pretrain(*bound.args, **bound.kwargs)
        except SystemExit as stop:
            # Megatron's exit at an iteration ends train() with sys.exit; at the switch, the run goes on.
            if not run.stopped_for_switch or stop.code not in (0, None):
                raise
        finally:
            for name, original in zip(scoped, originals):
                setattr(training_module, name, original)
        # Megatron-LM's own teardown before an in-process restart; the process group stays.
        training_module.destroy_global_state()
        return pretrain(*args, **kwargs)

    for owner in (training_package, training_module):
        _INSTALLED.append((owner, "pretrain", owner.pretrain))
        owner.pretrain = pretrain
    _add_flags_to_every_parse(layout)
    _use_prebuilt_dataset_helpers()
    _load_fp32_distributed_optimizer_without_grad()
    _save_fully_reshardable_optimizer_state_at_unpadded_offsets()
    _load_each_shard_once()


def _add_flags_to_every_parse(layout: StageLayout) -> None:
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize

    original = arguments.parse_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original(_chain(extra_args_provider, add_arguments), ignore_unknown_args)
        layout.apply(args)
        return args

    for owner in (arguments, initialize):
        _INSTALLED.append((owner, "parse_args", owner.parse_args))
        owner.parse_args = parse_args


def _load_fp32_distributed_optimizer_without_grad() -> None:
    """megatron-core 0.16's DistributedOptimizer loads a ``dp_reshardable`` checkpoint (torch_dist's default) by
    copying into its main params with autograd on; for fp32 weights those are views of the model's Parameters,
    so resuming fails ("a view of a leaf Variable that requires grad is being used in an in-place operation")
    on any device. Its other loaders run under no_grad; this one does too here."""
    import megatron.core
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not megatron.core.__version__.startswith("0.16."):
        return
    original = DistributedOptimizer.load_parameter_state_from_dp_reshardable
    _INSTALLED.append((DistributedOptimizer, "load_parameter_state_from_dp_reshardable", original))
    DistributedOptimizer.load_parameter_state_from_dp_reshardable = torch.no_grad()(original)


def _save_fully_reshardable_optimizer_state_at_unpadded_offsets() -> None:
    """megatron-core 0.16's DistributedOptimizer saves its fully reshardable format (the one dist checkpointing
    reshards across tensor and pipeline parallelism) from each buffer's state gathered bucket by bucket with the
    padding at the buckets' ends left out (``get_parameter_state_dp_zero``), but slices it at the parameters'
    offsets in the padded buffer: with several buckets, every parameter after a padded bucket end is saved with
    another's values ("param range exceeds unpadded buffer ... data corruption", its issue #504). A bucket of its
    own for each parameter of a shared set's copies (``stage_copies``), as for the word embeddings tied across
    pipeline stages, pads bucket ends. Here it slices at the offsets of what was gathered."""
    import megatron.core
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not megatron.core.__version__.startswith("0.16."):
        return
    original = DistributedOptimizer.sharded_param_state_fully_reshardable

    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        padded = [buffer.param_index_map for buffer in self.buffers]
        for buffer in self.buffers:
            buffer.param_index_map = _unpadded_param_index_map(buffer)
        try:
            return original(self, *args, **kwargs)
        finally:
            for buffer, index_map in zip(self.buffers, padded):
                buffer.param_index_map = index_map

    _INSTALLED.append((DistributedOptimizer, "sharded_param_state_fully_reshardable", original))
    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable


def _load_each_shard_once() -> None:
    """torch_dist loading, as written against megatron-core 0.16: see ``stage_copies.load_each_shard_once``."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    _INSTALLED.append((TorchDistLoadShardedStrategy, "load", TorchDistLoadShardedStrategy.load))
    TorchDistLoadShardedStrategy.load = stage_copies.load_each_shard_once(TorchDistLoadShardedStrategy.load)


def _unpadded_param_index_map(buffer) -> dict:
    """A buffer's ``param_index_map`` (parameter -> (start, end, bucket)) at offsets in its buckets' unpadded parts
    laid end to end."""
    shift, unpadded = {}, 0
    for bucket in buffer.buckets:
        shift[bucket.bucket_id] = unpadded - bucket.offset
        unpadded += bucket.numel_unpadded
    return {param: (start + shift[bucket], end + shift[bucket], bucket)
            for param, (start, end, bucket) in buffer.param_index_map.items()}


def _use_prebuilt_dataset_helpers() -> None:
    """Megatron-LM's initialize runs ``make`` in megatron/core/datasets to build ``helpers_cpp``: a source checkout
    has the Makefile, the megatron-core wheel has the built module and no Makefile (so the build, and the run,
    fail). With the wheel, skip the build."""
    import megatron.core.datasets.utils as dataset_utils

    folder = os.path.dirname(os.path.abspath(dataset_utils.__file__))
    built = importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
    if os.path.exists(os.path.join(folder, "Makefile")) or not built:
        return
    _INSTALLED.append((dataset_utils, "compile_helpers", dataset_utils.compile_helpers))
    dataset_utils.compile_helpers = lambda: None


def uninstall() -> None:
    while _INSTALLED:
        owner, name, original = _INSTALLED.pop()
        setattr(owner, name, original)


def run_script(script: str, args: List[str]) -> None:
    """Run SCRIPT as ``__main__`` with ARGS as its command line, the drop-in installed for the run (and removed
    after it). The process group and Megatron-LM's global state are left as the script leaves them."""
    from ds_pseudo_real.child_processes import end_children_with_this_process
    from megatron_patches import cpu_compat

    end_children_with_this_process()  # Megatron's checkpoint writers and results Manager end with the rank
    # Each repeated warning once from here on. Megatron-LM's own lines are left as it prints them: rank 0's, and
    # the last rank's (its iteration lines and timers); the drop-in's from rank 0.
    quiet_libraries()
    cpu_compat.install_training()  # a no-op when CUDA is available
    install()
    sys.argv = [script, *args]
    folder = os.path.dirname(os.path.abspath(script))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        uninstall()


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nRuns SCRIPT (a Megatron-LM pretraining script such as pretrain_gpt.py) unchanged, with "
              "these flags added to Megatron's parser (SCRIPT --help lists them with Megatron's):\n"
              "  --pseudo-to-real-switch-iter N, --pseudo-to-real-groups G,\n"
              "  --pseudo-to-real-optimizer-state {copy,reset,scale}, --pseudo-to-real-real-layout KEY=N,...,\n"
              "  --m6-expert-prototypes K")
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"{USAGE}\nmegatron_patches.run: error: SCRIPT {script!r} is not a file", file=sys.stderr)
        return 2
    try:
        run_script(script, argv[1:])
    except (DropInError, CheckpointError) as error:
        if _rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        # Megatron-LM's scripts leave the process group to the interpreter's teardown, where gloo's worker threads can
        # free tensors after Python has gone and abort a rank (SIGABRT) whose run passed
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
