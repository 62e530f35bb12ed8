"""One rank saving with ``checkpoint.async_save``: step 2's checkpoint published, then step 3's written slowly (each
file's bytes written, then a long pause before its fsync); prints ``writing <folder>`` once the first file's bytes are
out and trains on, until the test kills it with SIGKILL. Argument: the checkpoint folder."""
import sys
import time

from ds_pseudo_real import checksums
from test_checkpoints import make, train

folder = sys.argv[1]
engine = make(checkpoint={"async_save": True})
train(engine, 2)
engine.save_checkpoint(folder)
engine.wait_for_checkpoints()
train(engine, 3)
real_save = checksums.save_with_checksum


def written_then_stuck(save, path):
    def save_then_pause(handle):
        save(handle)
        print(f"writing {engine.checkpoint_in_flight}", flush=True)
        time.sleep(600)

    return real_save(save_then_pause, path)


checksums.save_with_checksum = written_then_stuck
engine.save_checkpoint(folder)
while True:  # training goes on while the checkpoint is written
    train(engine, engine.global_steps + 1)
    time.sleep(0.05)
