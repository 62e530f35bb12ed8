"""The engine users hold: a DeepSpeed engine stand-in that runs the callbacks and delinks when they say so.

Owns: proxying the current engine, ``step`` with the stage's LR factor, the callbacks, and the run's state. Must not
build engines (``stages`` does) nor read or write checkpoints (``checkpointing`` does); it hands them what they need.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from .callbacks import PSEUDO, REAL, CallbackList, RunState, TrainingCallback, TrainingControl, TrainingState
from .checkpointing.engine_io import Checkpoints
from .config import SECTION, PlateauMetric
from .device import use_rank_device
from .pipeline import stage_builder
from .ranks import log_rank0
from .run_config import RunConfig
from .stages import DESTROYED_MODULE
from .transition import StageTransitionCallback, lr_factor


class CurrentOf:
    """What ``initialize`` returns for the optimizer and the LR scheduler: a view of the controller's current one.

    Attributes and methods are those of the current engine's object, so code written against the returned optimizer
    keeps working after the delink, and holding it does not keep the pseudo engine (whose optimizer is linked to it
    through DeepSpeed's hooks) alive.
    """

    def __init__(self, controller: "PseudoToRealController", name: str):
        object.__setattr__(self, "_controller", controller)
        object.__setattr__(self, "_name", name)

    def current(self):
        return getattr(self._controller, self._name)

    def __getattr__(self, attribute: str):
        return getattr(self.current(), attribute)

    def __setattr__(self, attribute: str, value) -> None:
        setattr(self.current(), attribute, value)

    def __repr__(self) -> str:
        return f"CurrentOf({self._name}: {self.current()!r})"


class PseudoToRealController:
    """Use it like a DeepSpeed engine: ``loss = engine(batch); engine.backward(loss); engine.step()``.

    Any attribute not defined here is read from the current DeepSpeed engine, which is replaced at the delink:
    hold on to the controller, not to ``controller.engine``, ``.optimizer`` or ``.lr_scheduler``. ``run_config`` is
    the run's :class:`~ds_pseudo_real.run_config.RunConfig`; ``config`` its ``pseudo_to_real`` section, ``ds_config``
    what each ``deepspeed.initialize`` gets and ``checkpoint_options`` the plugin's ``checkpoint`` keys.
    """

    def __init__(
        self,
        model: nn.Module,
        config: RunConfig,
        *,
        optimizer: Optional[Callable] = None,
        model_parameters: Optional[Callable[[nn.Module], Iterable]] = None,
        lr_scheduler: Optional[Callable] = None,
        training_data=None,
        collate_fn=None,
        mpu=None,
        callbacks: Iterable[TrainingCallback] = (),
    ):
        for name, value, what in (
            ("optimizer", optimizer, "a callable(params) -> torch.optim.Optimizer"),
            ("model_parameters", model_parameters, "a callable(model) -> parameters or param groups"),
            ("lr_scheduler", lr_scheduler, "a callable(optimizer) -> scheduler"),
        ):
            if value is not None and not callable(value):
                raise TypeError(
                    f"{name}: got a {type(value).__name__}; pass None or {what}, so that it can be built again for "
                    f"the real model at the delink"
                )
        use_rank_device()  # before the offload plan's store and streams and the engine are made
        self.run_config = config
        self.config = ptr_config = config.pseudo_to_real
        self.ds_config, self.checkpoint_options = config.deepspeed, config.checkpoint
        self._triggers = ptr_config.triggers
        self._pseudo_lr_scale, self._rewarmup_steps = ptr_config.pseudo_lr_scale, ptr_config.rewarmup_steps
        self._track_train_loss = ptr_config.enabled and any(
            t.on_plateau is not None and t.on_plateau.metric == PlateauMetric.TRAINING.value for t in self._triggers)
        self._stages = stage_builder(model, ptr_config, config.granular_offload, config.training, config.deepspeed,
                               optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                               mpu=mpu, step_hooks=(self._scale_lr, self._unscale_lr))
        self.layer_path, self.num_layers = self._stages.layer_path, self._stages.num_layers
        self.stages = self._stages.stages
        self.stage_groups = [groups for _, groups in self.stages]
        if not config.pseudo_to_real_given:
            log_rank0(f"no '{SECTION}' section in the config: Pseudo-to-Real is off, the real model trains from step 0")
        elif not ptr_config.enabled:
            log_rank0(f"{SECTION}.enabled is false: Pseudo-to-Real is off, the real model trains from step 0")
        builtin = [StageTransitionCallback(self._triggers)] if ptr_config.enabled else []
        self._run = RunState(TrainingState(stage=PSEUDO if ptr_config.enabled else REAL, groups=self.groups),
                             CallbackList(builtin + list(callbacks)))
        self.control = TrainingControl()
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._lr_factor = 1.0
        self.last_transition: Optional[Dict[str, Any]] = None
        self.training_dataloader = self._stages.start(self.state.stage, training_data, collate_fn)
        self._checkpoints = Checkpoints(self._stages, self._run, self.checkpoint_options,
                                        pseudo_to_real=ptr_config.enabled)
        self.callbacks.fire("on_train_begin", self.state, self.control)

    # ---- what the parts hold -------------------------------------------------------------------------------
    @property
    def engine(self):
        """The current stage's DeepSpeed engine (a new one after each delink)."""
        return self._stages.engine

    @property
    def optimizer(self):
        return self._stages.optimizer

    @property
    def lr_scheduler(self):
        return self._stages.lr_scheduler

    @property
    def offload_plan(self):
        """Granular offload's plan of the current stage's model (None without the section)."""
        return self._stages.offload_plan

    @property
    def depth(self) -> int:
        return self._stages.depth

    @property
    def groups(self) -> int:
        return self._stages.groups

    @property
    def state(self) -> TrainingState:
        return self._run.state

    @property
    def callbacks(self) -> CallbackList:
        return self._run.callbacks

    @property
    def run_id(self) -> str:
        """The run this one goes on as: its own id, or after a resume the checkpoint's run."""
        return self._checkpoints.run_id

    def __getattr__(self, name: str):
        stages = self.__dict__.get("_stages")
        engine = stages.engine if stages is not None else None
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    # ---- the training-loop surface --------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.engine.module.training:
            first = next((a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)), None)
            if first is not None:
                self.state.tokens_seen += first.numel() * self.engine.dp_world_size
        return self.engine(*args, **kwargs)

    def backward(self, loss, **kwargs):
        """``loss`` is a tensor, or a model output object holding one as ``.loss`` (Hugging Face ``ModelOutput``)."""
        if not torch.is_tensor(loss) and torch.is_tensor(getattr(loss, "loss", None)):
            loss = loss.loss
        if self._track_train_loss:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_count += 1
        return self.engine.backward(loss, **kwargs)

    def step(self, **kwargs):
        boundary = self.engine.is_gradient_accumulation_boundary()
        self._lr_factor = self._stage_lr_factor()
        result = self.engine.step(**kwargs)
        self._lr_factor = 1.0
        if boundary:
            self._step_ended()
        return result

    def train_batch(self, data_iter=None):
        """A PipelineModule's training step (DeepSpeed's ``PipelineEngine.train_batch``: the batch's micro batches
        through the pipeline, then one optimizer step), then the callbacks, and the delink when they say so; returns
        the batch's mean loss, the same on every rank. ``data_iter`` None: the iterator of the ``training_data``
        given to ``initialize``, read on across the delink."""
        self._lr_factor = self._stage_lr_factor()
        loss = self.engine.train_batch(data_iter)
        self._lr_factor = 1.0
        if self._track_train_loss:
            self._loss_sum, self._loss_count = loss.detach().float(), 1
        self._step_ended()
        return loss

    def _stage_lr_factor(self) -> float:
        since = None if self.state.switch_step is None else self.engine.global_steps - self.state.switch_step
        return lr_factor(self.state.stage == PSEUDO, self._pseudo_lr_scale, since, self._rewarmup_steps)

    def _step_ended(self) -> None:
        """After an optimizer step: the state, the callbacks, and the delink when they ask for it."""
        self.state.global_step = self.engine.global_steps
        if self._track_train_loss and self._loss_count:
            self.state.last_train_loss = float(self._loss_sum) / self._loss_count
            self._loss_sum, self._loss_count = None, 0
        self.callbacks.fire("on_step_end", self.state, self.control)
        self._maybe_delink()  # a checkpoint in flight is written from its host copy: complete once saved
        self._checkpoints.poll()  # last: a background save's failure raised here leaves the step complete

    def _scale_lr(self, optimizer, *_):
        """Step pre-hook: the stage's LR factor (``pseudo_lr_scale``, the re-warmup) applies to this optimizer step
        only (ZeRO steps group by group); the scheduler keeps the schedule's values."""
        if self._lr_factor != 1.0:
            self._unscaled_lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] *= self._lr_factor

    def _unscale_lr(self, optimizer, *_):
        if self._lr_factor != 1.0:
            for group, lr in zip(optimizer.param_groups, self._unscaled_lrs):
                group["lr"] = lr

    def report_eval(self, metrics: Dict[str, float]) -> None:
        """Hand evaluation metrics (e.g. ``{"val_loss": 2.1}``) to the callbacks; may delink right away."""
        self.callbacks.fire("on_evaluate", self.state, self.control, metrics)
        self._maybe_delink()

    @property
    def stage(self) -> str:
        return self.state.stage

    def _maybe_delink(self) -> None:
        """Delink when a callback asked for it, after a step DeepSpeed applied. A step it skipped (inf or NaN
        gradients: an fp16 overflow, the scale halved) left the step before's weights: the delink waits for the next
        applied step (``state.delink_pending``, kept in checkpoints), so that the next stage starts from an update."""
        if self.state.stage != PSEUDO or not (self.control.should_delink or self.state.delink_pending):
            return
        self.control.should_delink = False
        if self.engine.global_steps and not self.engine.was_step_applied():
            if not self.state.delink_pending:
                log_rank0(f"step {self.engine.global_steps} was skipped (inf or NaN gradients): the delink waits for "
                          f"the next step applied")
            self.state.delink_pending = True
            return
        self.state.delink_pending = False
        self.delink()

    # ---- the delink ----------------------------------------------------------------------------------------
    @property
    def next_stage(self) -> Optional[Tuple[int, int]]:
        """(layers, parameter groups) of the stage the next transition goes to (None in the last stage)."""
        index = self.state.transitions_done + 1
        return self.stages[index] if index < len(self.stages) and self.state.stage == PSEUDO else None

    @property
    def next_trigger(self):
        """The trigger of the next transition (a ``SwitchTrigger``), None in the last stage."""
        done = self.state.transitions_done
        return self._triggers[done] if self.next_stage is not None and done < len(self._triggers) else None

    def delink(self) -> Dict[str, Any]:
        """Turn the pseudo engine into the next stage's, in process: the real one, or with a progressive schedule
        the model with the next stage's groups (every group split into equal runs of consecutive layers, each run
        starting from the group's values); returns (and logs) what was done."""
        if self.next_stage is None:
            raise RuntimeError(f"delink() called in the {self.state.stage} stage, with no stage after it")
        report = self._stages.delink(self.next_stage, self.state)
        self.last_transition = report
        self.callbacks.fire("on_delink", self.state, report)
        return report

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict] = None) -> str:
        """Write a checkpoint atomically: ``<tag>.<writer>.partial`` by every rank (each file checksummed as it is
        written and fsynced), then rank 0 adds the manifest and renames it to ``<tag>`` + ``latest``, then applies
        ``checkpoint.keep_last`` to this run's checkpoints. With ``checkpoint.async_save`` it returns once the state
        is copied to host memory (after waiting for the checkpoint still in flight, if any); the rest happens in the
        background, and a failure there is raised by a later ``step``, save or :meth:`wait_for_checkpoints`. A
        ``tag`` that names another run's checkpoint is refused before anything is written, and so is every save once
        the folder's lock file names another run (:class:`~ds_pseudo_real.checkpointing.CheckpointError` on every rank).
        A failed write on any rank raises CheckpointError on every rank, naming the file and the last good
        checkpoint; the partial folder is removed and training can go on (a later save can succeed once the cause
        is gone)."""
        return self._checkpoints.save(save_dir, tag, client_state)

    def wait_for_checkpoints(self) -> None:
        """With ``checkpoint.async_save``: block until the checkpoint being written in the background is published
        (collective), raising its failure as :class:`~ds_pseudo_real.checkpointing.CheckpointError` on every rank. Call
        it before the process ends, or that checkpoint is lost (the previous one stays the one to resume from). A
        no-op for synchronous saves."""
        self._checkpoints.wait("the run goes on")

    @property
    def checkpoint_in_flight(self) -> Optional[str]:
        """The folder of the checkpoint being written in the background (``checkpoint.async_save``), or None."""
        background = self._checkpoints.background
        return None if background is None else background.in_flight

    def load_checkpoint(self, load_dir: Optional[str], tag: Optional[str] = None, *, verify: Optional[str] = None,
                        **kwargs) -> Tuple[Optional[str], Dict]:
        """Resume from a checkpoint of either stage (or a converted one); becomes real first when it is a real one.

        ``tag`` None: the newest checkpoint in ``load_dir`` that verifies (damaged newer ones are moved aside with a
        warning; :class:`~ds_pseudo_real.checkpointing.CheckpointError` when checkpoints exist but none verifies);
        ``(None, {})`` when ``load_dir`` holds none. ``tag`` given (a tag in ``load_dir`` or the path of a checkpoint
        folder): that one, which must verify. ``verify`` overrides ``checkpoint.verify`` (checksum, size, none).
        The run then goes on as the checkpoint's run (its saves may replace that run's later checkpoints); with
        ``tag`` None, rank 0 first takes ``load_dir``'s lock, as the first save there does.
        """
        chosen = self._checkpoints.choose(load_dir, tag, verify)
        if chosen is None:
            return None, {}
        stages = self._stages
        stage = chosen.stage(stages.num_layers)
        if chosen.converted:  # the model of its stage, built from its fp32 weights
            stages.release()
            stages.build(*stage, chosen.converted_weights(), self.state)
            return self._checkpoints.restore_converted(chosen)
        if stage != (stages.depth, stages.groups):  # a later stage's checkpoint: that stage's model first
            stages.release()
            stages.build(*stage, None, self.state)
        return self._checkpoints.restore(chosen, **kwargs)

    def destroy(self) -> None:
        """End the current engine and give back what it held: granular offload's hooks taken off the model, a
        delayed host step in flight finished and its worker stopped, then DeepSpeed's ``destroy``; the module's
        weights are released (a forward raises). Save a checkpoint first to keep them. DeepSpeed's own
        ``engine.engine.destroy()`` does not reach the offload's optimizer under ZeRO."""
        self._stages.release(DESTROYED_MODULE)

    def rewind_monitors(self) -> None:
        """Drop what DeepSpeed's TensorBoard and CSV monitors logged after the current step (an interrupted run's
        tail; CSV rows kept in ``<file>.discarded``), so that the run's monitor output reads as one run's.
        ``load_checkpoint`` does it; call it when a run starts over without loading one."""
        self._checkpoints.rewind_monitors()
