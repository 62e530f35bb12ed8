"""STAND-IN (tests only): pretrain / setup_model_and_optimizer / train / train_step with Megatron-LM's
signatures and call structure (train() calls the module-level train_step with the same model list and optimizer
object every iteration and sets args.curr_iteration first; setup_model_and_optimizer builds the model, then loads
--load; train() saves every --save-interval iterations; --bf16 wraps the model in Float16Module and
takes Megatron's bf16 optimizer), on real megatron.core components."""
import json

import torch
import torch.distributed as dist

from .arguments import parse_args
from .checkpointing import load_checkpoint, save_checkpoint
from .global_vars import get_args, set_args


class _ConstantLR:
    """Stand-in for OptimizerParamScheduler: holds the optimizer and counts samples like the real one does."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.num_steps = 0

    def step(self, increment):
        self.num_steps += increment

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state_dict):
        self.num_steps = state_dict["num_steps"]


def _num_microbatches(args):
    from megatron.core import parallel_state

    return args.global_batch_size // (args.micro_batch_size * parallel_state.get_data_parallel_world_size())


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, **kwargs):
    set_args(parse_args(extra_args_provider))
    args = get_args()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                             expert_model_parallel_size=args.expert_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    train_data_iterator = iter(train_valid_test_dataset_provider([args.train_iters * args.global_batch_size, 0, 0])[0])
    for _ in range(args.iteration * _num_microbatches(args)):  # Megatron's sampler starts past the consumed samples
        next(train_data_iterator)
    from megatron.core.utils import get_model_config

    train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, None, None,
          get_model_config(model[0]), None, None)
    dist.destroy_process_group()


def get_model(model_provider_func, model_type, wrap_with_ddp=True):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    args = get_args()
    torch.manual_seed(args.seed)
    model = [model_provider_func(pre_process=True, post_process=True)]
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = [Float16Module(m.config, m) for m in model]
    if not wrap_with_ddp:
        return model
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    return [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m) for m in model]


def setup_model_and_optimizer(model_provider_func, model_type, checkpointing_context=None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    args = get_args()
    model = get_model(model_provider_func, model_type)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                                       clip_grad=args.clip_grad, bf16=args.bf16,
                                                       params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                                       use_distributed_optimizer=args.use_distributed_optimizer), model)
    opt_param_scheduler = _ConstantLR(optimizer)
    if args.load is not None:
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(model, optimizer,
                                                                                    opt_param_scheduler)
    return model, optimizer, opt_param_scheduler


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func):
    from megatron.core import parallel_state

    args = get_args()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                   num_microbatches=_num_microbatches(args),
                                   seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                   forward_only=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    opt_param_scheduler.step(increment=args.global_batch_size)
    total = sum(x["lm loss"] for x in losses)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    loss_dict = {"lm loss": float(total[0] / total[1])}
    return loss_dict, 0, False, False, 0, grad_norm, num_zeros_in_grad


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config, checkpointing_context, non_loss_data_func):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = get_args()
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in model]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
        if len(model) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    log = []
    iteration = args.iteration
    while iteration < args.train_iters:
        args.curr_iteration = iteration
        loss_dict, *_ = train_step(forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler,
                                   config, get_forward_backward_func())
        module = model[0].module
        unique = {id(p): p.numel() for p in module.parameters()}
        log.append({"iteration": iteration, "loss": loss_dict["lm loss"], "params": sum(unique.values()),
                    "routers": sorted({type(m).__name__ for m in module.modules() if hasattr(m, "routing")}),
                    "dtypes": sorted({str(p.dtype) for p in module.parameters()}),
                    "optimizers": sorted({type(o).__name__ for o in getattr(optimizer, "chained_optimizers",
                                                                              [optimizer])})})
        iteration += 1
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler)
    if args.log_json and dist.get_rank() == 0:
        with open(args.log_json, "w") as handle:
            json.dump(log, handle)
