"""Trainer.step reads the next step's batch while the current step computes (`prefetch_batches`)."""
import math

import pytest

from surojax.config import config_from_dict
from surojax.train.trainer import Trainer


def test_data_running_out_stops_at_the_step_that_would_take_the_missing_batch(tiny_config):
    """A step whose read-ahead finds no next batch still returns its metrics; the following step stops the run
    with StopIteration (the training loop's "data ran out"), having changed nothing."""
    trainer = Trainer(config_from_dict(tiny_config(max_steps=4)))
    real, served = trainer.next_batch, []

    def two_batches():
        if len(served) == 2:
            raise StopIteration
        served.append(real())
        return served[-1]

    trainer.next_batch = two_batches
    assert math.isfinite(trainer.step()["loss"]) and len(served) == 2  # batch 2 read ahead during step 1
    assert math.isfinite(trainer.step()["loss"])  # its read-ahead found no batch 3: not this step's error
    with pytest.raises(StopIteration):
        trainer.step()
    assert trainer.step_count == 2
