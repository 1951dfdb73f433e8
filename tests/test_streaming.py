"""Streaming and variable-length data: IterableDataset sharded across ranks and workers, the same
steps on every rank, exact resume; data.collate with one-line errors (issue 28, finding 4);
zero-step runs refused (finding 3)."""

import sys
import types

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from ddpx.data.collate import Collate, CollateError
from ddpx.data.stream import ShardedStream, batches_per_rank
from ddpx.errors import DdpxError
from ddpx.train.trainer import Trainer


class Numbers(IterableDataset):
    """Samples (x, y) numbered 0..n-1: x carries the number, so a test sees who trained what."""

    def __init__(self, n=100):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            x = torch.zeros(64)
            x[0] = i
            yield x, i % 10


class NoLength(IterableDataset):
    def __iter__(self):
        yield torch.zeros(64), 0


def _module(**objects):
    """A module the config can name (data.target: streams_under_test.NAME)."""
    module = types.ModuleType("streams_under_test")
    module.__dict__.update(objects)
    sys.modules["streams_under_test"] = module
    return module


def test_each_sample_goes_to_exactly_one_rank_and_worker():
    seen = []
    for world in (1, 2, 3):
        for workers in (1, 2):
            taken = []
            for rank in range(world):
                stream = ShardedStream(Numbers(17), rank, world, seed=0)
                for worker in range(workers):
                    info = types.SimpleNamespace(num_workers=workers, id=worker)
                    import ddpx.data.stream as module

                    original = module.get_worker_info
                    module.get_worker_info = lambda: info if workers > 1 else None
                    try:
                        taken += [int(x[0]) for x, _ in stream]
                    finally:
                        module.get_worker_info = original
                    if workers == 1:
                        break
            assert sorted(taken) == list(range(17)), (world, workers)
            seen.append(len(taken))
    assert batches_per_rank(17, 0, 2, 2, 4) == 3 and batches_per_rank(17, 1, 2, 2, 4) == 2  # 9 and 8 samples


def test_a_stream_trains_the_same_steps_on_every_rank_and_resumes_exactly(make_config, tmp_path):
    _module(numbers=lambda n: Numbers(n))
    common = ["data.target=streams_under_test.numbers", "data.args={n: 44}", "trainer.batch_size=8",
              "trainer.eval_every_epochs=0", "trainer.epochs=2"]
    whole = Trainer(make_config(*common, run_dir=tmp_path / "whole"))
    metrics = whole.run()
    assert [m["step"] for m in metrics] == [6, 12]  # ceil(44 / 8) per epoch on one rank
    final = {k: v.clone() for k, v in whole.module.state_dict().items()}

    Trainer(make_config(*common, "trainer.max_steps=4", run_dir=tmp_path / "cut")).run()
    resumed = Trainer(make_config(*common, run_dir=tmp_path / "cut"))
    resumed.run()
    assert resumed.global_step == 12
    for key, value in resumed.module.state_dict().items():
        assert torch.equal(value, final[key]), key  # the same batches, none twice


def test_a_stream_without_length_is_one_line(make_config):
    _module(nolength=lambda: NoLength())
    with pytest.raises(DdpxError, match="has no __len__: define __len__ as the number of samples in one epoch"):
        Trainer(make_config("data.target=streams_under_test.nolength", "data.args={}")).run()


@pytest.mark.parametrize("overrides, words", [
    (["data.target=streams_under_test.empty"], "the training set of data.target streams_under_test.empty is empty"),
    (["sampler.drop_last=true", "trainer.batch_size=4096"], "zero steps per epoch: 1438 training samples do not"),
])
def test_runs_that_would_do_nothing_stop_at_setup(make_config, tmp_path, overrides, words):
    _module(empty=lambda: (torch.utils.data.TensorDataset(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long)), None))
    with pytest.raises(DdpxError, match=words):
        Trainer(make_config(*overrides, "data.args={}" if "empty" in overrides[0] else "trainer.epochs=1")).run()
    assert not list((tmp_path / "run").glob("checkpoints/step-*.pt"))  # no step-0 checkpoint


def test_variable_length_samples_name_the_collate_key():
    samples = [torch.zeros(3), torch.zeros(5)]
    with pytest.raises(CollateError) as info:
        Collate(None)(samples)
    assert "samples of different sizes need data.collate: module.function" in str(info.value)
    _module(pad=lambda batch: torch.nn.utils.rnn.pad_sequence(batch, batch_first=True),
            broken=lambda batch: 1 / 0)
    from ddpx_plugins.sampler import _collate

    assert _collate("streams_under_test.pad")(samples).shape == (2, 5)
    with pytest.raises(CollateError, match="data.collate streams_under_test.broken failed on a batch of 2 samples: "
                                           "ZeroDivisionError"):
        _collate("streams_under_test.broken")(samples)


def test_a_collate_error_from_a_worker_is_cut_back_to_one_line():
    wrapped = CollateError("Caught CollateError in DataLoader worker process 0.\nOriginal Traceback (most recent "
                           "call last):\n  File \"x.py\", line 1\nddpx.data.collate.CollateError: data.collate m.f "
                           "failed on a batch of 2 samples: ValueError: bad\n")
    assert str(wrapped) == "data.collate m.f failed on a batch of 2 samples: ValueError: bad"


def test_data_collate_must_resolve():
    from ddpx.config import load_config

    with pytest.raises(DdpxError, match="data.collate"):
        load_config(None, ["data.collate=no_such_module.fn"])


STREAM_MODULE = '''
import torch
from torch.utils.data import IterableDataset

class Numbers(IterableDataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __iter__(self):
        for i in range(self.n):
            x = torch.zeros(64)
            x[0] = i
            yield x, i % 10

def numbers(n):
    return Numbers(n)
'''


@pytest.mark.slow
def test_two_ranks_with_uneven_shards_and_workers_run_the_same_steps_without_hanging(ranks, tmp_path):
    """97 samples on 2 ranks x 2 workers, batches of 8: shards of 49 and 48 samples, worker shares
    of 25/24 (4 + 3 batches) and 24/24 (3 + 3): both ranks train 6 batches (the smallest) per epoch
    and end every epoch together, although rank 0's loader has a seventh."""
    (tmp_path / "stream_data.py").write_text(STREAM_MODULE)
    config = tmp_path / "c.yaml"
    run_dir = tmp_path / "run"
    config.write_text(f"run_dir: {run_dir}\ndata: {{target: stream_data.numbers, args: {{n: 97}}}}\n"
                      "trainer: {epochs: 2, batch_size: 8, num_workers: 2, eval_every_epochs: 0}\n"
                      "logging: {progress: false}\n")
    ranks.train(run_dir, config, 2, timeout=240)
    import json

    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["step"]) for e in epochs if "epoch" in e and "step" in e][-2:] == [(0, 6), (1, 12)]
