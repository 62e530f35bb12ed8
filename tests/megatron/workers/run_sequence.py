"""Several runs of a Megatron-LM training script through the drop-in in one launch, for the tests: each run as
``python -m megatron_patches.run SCRIPT FLAGS...`` makes it, one after the other in the same processes, with
Megatron-LM's own teardown between them (``destroy_global_state``, as the drop-in's in-process layout switch uses);
one gloo process group for all of them. One launch instead of one per run saves each run the start of the processes
and their imports.

Usage: run_sequence.py STEPS.json, a list of steps in order:
  {"run": NAME, "argv": [SCRIPT, FLAG...]}   a run; its output starts with a line "=== run NAME" (stdout and stderr)
  {"copy": [SAVED, ITERATION, DIRECTORY]}     rank 0 copies SAVED's checkpoint of ITERATION into DIRECTORY alone
                                             (as after a crash right after it was written); the others wait
"""
import json
import os
import sys
from pathlib import Path

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]


def main(steps_file: str) -> None:
    # Imported here, not at the top: a process started with the spawn method runs the top of this file again.
    import megatron.training.training as training_module
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue
    from megatron_lm import RUN_MARKER, copy_checkpoint

    from megatron_patches.run import run_script

    # Megatron's torch_dist writer makes one results queue per process at its first save: a Manager process started
    # with the spawn method, which runs the top of the __main__ module again. During a run __main__ is the training
    # script (runpy), whose imports (megatron.training, transformers) cost that process about 5 s of CPU; made here
    # first, by the same function, with this file as __main__, the same queue costs it a fraction of a second. What
    # the writer does with the queue is unchanged.
    from ds_pseudo_real.child_processes import end_children_with_this_process

    end_children_with_this_process()  # as run_script does, before the queue's Manager process starts
    _get_write_results_queue()

    dist.init_process_group("gloo")  # before a copy step's barrier; Megatron-LM takes an initialised group as it is
    try:
        for step in json.loads(Path(steps_file).read_text()):
            if "copy" in step:
                saved, iteration, directory = step["copy"]
                if dist.get_rank() == 0:
                    copy_checkpoint(Path(saved), iteration, Path(directory))
                dist.barrier()
                continue
            # Every rank's output of the run before is out before the line, the run's after it.
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            dist.barrier()
            if dist.get_rank() == 0:
                for stream in (sys.stdout, sys.stderr):
                    print(RUN_MARKER + step["run"], file=stream, flush=True)
            dist.barrier()
            try:
                run_script(step["argv"][0], step["argv"][1:])
            except SystemExit as stop:  # Megatron-LM ends a run at --exit-interval with sys.exit(0)
                if stop.code not in (0, None):
                    raise
            training_module.destroy_global_state()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
