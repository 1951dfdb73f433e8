"""Streaming and variable-length data: IterableDataset sharded across ranks and workers, the same
steps on every rank, exact resume; data.collate with one-line errors (issue 28, finding 4);
zero-step runs refused (finding 3)."""

import itertools
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


class Counting(IterableDataset):
    """A stream without __len__: n samples numbered as Numbers' (n=None: unbounded); records its epochs."""

    epochs: list = []

    def __init__(self, n=None):
        self.n = n

    def set_epoch(self, epoch):
        Counting.epochs.append(epoch)

    def __iter__(self):
        for i in itertools.count() if self.n is None else range(self.n):
            x = torch.zeros(64)
            x[0] = i
            yield x, i % 10


def test_a_stream_without_length_trains_until_its_data_ends_and_resumes_exactly(make_config, tmp_path, capfd):
    _module(counting=lambda n: Counting(n))
    common = ["data.target=streams_under_test.counting", "data.args={n: 44}", "trainer.batch_size=8",
              "trainer.eval_every_epochs=0", "trainer.epochs=3"]
    Counting.epochs = []
    whole = Trainer(make_config(*common, run_dir=tmp_path / "whole"))
    metrics = whole.run()
    assert [m["step"] for m in metrics] == [6, 12, 18]  # ceil(44 / 8) per epoch: the epoch ends with the data
    assert Counting.epochs == [0, 1, 2]  # set_epoch before each pass
    final = {k: v.clone() for k, v in whole.module.state_dict().items()}

    Trainer(make_config(*common, "trainer.max_steps=10", run_dir=tmp_path / "cut")).run()
    capfd.readouterr()
    resumed = Trainer(make_config(*common, run_dir=tmp_path / "cut"))
    resumed.run()
    assert "epoch 1's stream is read again from its start and each rank skips the batches it already trained " \
           "(rank 0: 4), not trained again" in capfd.readouterr().err
    assert resumed.global_step == 18
    for key, value in resumed.module.state_dict().items():
        assert torch.equal(value, final[key]), key  # the same batches, none twice


class Told(Counting):
    """Counting that writes each set_epoch it gets to a file: DataLoader workers are other processes."""

    def __init__(self, n, path):
        super().__init__(n)
        self.path = path

    def set_epoch(self, epoch):
        with open(self.path, "a") as f:
            f.write(f"{epoch}\n")


@pytest.mark.slow
def test_each_dataloader_worker_is_told_the_epoch_of_a_stream_without_length(make_config, tmp_path):
    _module(told=lambda n, path: Told(n, path))
    told = tmp_path / "told.txt"
    metrics = Trainer(make_config("data.target=streams_under_test.told", f"data.args={{n: 40, path: '{told}'}}",
                                  "trainer.batch_size=4", "trainer.num_workers=2", "trainer.eval_every_epochs=0",
                                  "trainer.epochs=3")).run()
    assert [m["step"] for m in metrics] == [10, 20, 30]  # two workers of 20 samples: 5 + 5 batches an epoch
    assert sorted(int(line) for line in told.read_text().split()) == [0, 0, 1, 1, 2, 2]  # persistent workers


def test_an_unbounded_stream_ends_at_max_steps(make_config, tmp_path):
    _module(counting=lambda n: Counting(n))
    trainer = Trainer(make_config("data.target=streams_under_test.counting", "data.args={n: null}",
                                  "trainer.batch_size=8", "trainer.eval_every_epochs=0", "trainer.max_steps=7"))
    metrics = trainer.run()
    assert trainer.global_step == 7 and [(m["epoch"], m["step"]) for m in metrics] == [(0, 7)]
    assert not trainer.epoch_finished  # the stream did not end: a resume goes on in epoch 0


def test_an_empty_stream_is_one_line(make_config):
    _module(counting=lambda n: Counting(n))
    with pytest.raises(DdpxError, match="the training stream of data.target streams_under_test.counting gave no "
                                        "batch in epoch 0: nothing to train on; check data.args"):
        Trainer(make_config("data.target=streams_under_test.counting", "data.args={n: 0}")).run()


def test_stream_shard_names_each_rank_and_workers_part():
    import ddpx.data.stream as module

    class Mine(IterableDataset):
        ddpx_shards_itself = True

        def __iter__(self):
            yield module.stream_shard()

    parts = []
    original = module.get_worker_info
    try:
        for rank in range(3):
            for worker in range(2):
                module.get_worker_info = lambda: types.SimpleNamespace(num_workers=2, id=worker)
                parts += list(ShardedStream(Mine(), rank, 3, seed=0))
    finally:
        module.get_worker_info = original
    assert parts == [(0, 6), (1, 6), (2, 6), (3, 6), (4, 6), (5, 6)]


def test_a_stream_without_length_resumed_on_other_ranks_or_workers_restarts_its_epoch_and_says_so():
    from ddpx.data.stream import StreamLoader

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, line):
            self.lines.append(line)

        warning = info

    def loader(rank, world_size, workers):
        stream = ShardedStream(Counting(20), rank, world_size, seed=0)
        return StreamLoader(DataLoader(stream, batch_size=2), stream, workers)

    saved = loader(0, 2, 1)
    saved.set_epoch(3)
    saved.consumed = 4
    state = saved.state_dict()
    same, log = loader(1, 2, 1), Log()
    same.load_state_dict({**state, "consumed": 3}, log)  # rank 1's own entry
    assert (same.epoch, same.consumed) == (3, 3) and [int(x[0][0]) for x, _ in same] == [13, 17]
    assert log.lines == ["streaming data: epoch 3's stream is read again from its start and each rank skips the "
                         "batches it already trained (rank 1: 3), not trained again"]
    for rank, world_size, workers in ((0, 3, 1), (0, 2, 2)):
        other, log = loader(rank, world_size, workers), Log()
        other.load_state_dict(state, log)
        assert (other.epoch, other.consumed) == (3, 0)
        assert log.lines == [f"streaming data: the checkpoint's stream was split among 2 ranks x 1 workers, now "
                             f"{world_size} x {workers}: its place cannot be found, so epoch 3 starts again from its "
                             "beginning (its batches trained before the checkpoint are trained again)"]


def test_a_hugging_face_stream_split_among_workers_by_itself_must_shard_itself():
    from ddpx.data.stream import check_worker_split

    hf = type("IterableDataset", (Counting,), {"__module__": "datasets.iterable_dataset"})
    with pytest.raises(DdpxError, match="data.target m.f returned a datasets IterableDataset, which splits itself "
                                        "among DataLoader workers, so ddpx must not split it again"):
        check_worker_split(hf(), "m.f", 2)
    flagged = hf()
    flagged.ddpx_shards_itself = True
    for dataset, workers in ((hf(), 1), (flagged, 2), (Counting(), 2)):
        check_worker_split(dataset, "m.f", workers)  # one worker, a stream that shards itself, any other stream


def test_stop_checks_come_at_least_every_10_steps_over_a_stream_without_length():
    from types import SimpleNamespace

    from ddpx.train.stopping import StopAgreement

    trainer = SimpleNamespace(global_step=0, world_size=1, rank=0, device=torch.device("cpu"))
    stops = StopAgreement(trainer, 0, 1.0, 20.0)
    assert stops.interval(1e-7) == 1000
    stops.most_steps = 10  # what StreamEnd sets: the padding at an epoch's end lasts at most two checks
    assert [stops.interval(s) for s in (None, 1e-7, 0.5)] == [10, 10, 2]


def test_the_smoke_run_takes_the_head_of_a_stream():
    from ddpx.smoke.rank import data_slice

    class Mine(Counting):
        ddpx_shards_itself = True

    _module(mine=lambda: Mine(None))
    Counting.epochs = []
    train, _ = data_slice("streams_under_test.mine", {}, 5, 2)
    assert train.ddpx_shards_itself and not hasattr(train, "__len__")
    train.set_epoch(3)
    assert [int(x[0]) for x, _ in train] == [0, 1, 2, 3, 4] and Counting.epochs == [3]


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


UNSIZED_STREAM_MODULE = '''
import itertools

import torch
from torch.utils.data import IterableDataset

from ddpx.data.stream import stream_shard


class Unbounded(IterableDataset):
    """Numbered samples without end and without __len__ (ddpx shards it: every rank reads it all)."""
    def __iter__(self):
        for i in itertools.count():
            x = torch.zeros(64)
            x[0] = i
            yield x, i % 10


class Uneven(IterableDataset):
    """Each rank reads only its own shard, of lengths[rank] samples: rank 0's data ends first."""
    ddpx_shards_itself = True

    def __init__(self, lengths):
        self.lengths = lengths

    def __iter__(self):
        part, parts = stream_shard()
        for i in range(self.lengths[part]):
            x = torch.zeros(64)
            x[0] = part + i / 100
            yield x, i % 10


def unbounded():
    return Unbounded()


def uneven(lengths):
    return Uneven(lengths)
'''


def _epoch_steps(run_dir):
    import json

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(e["epoch"], e["step"]) for e in lines if "epoch" in e and "step" in e]


@pytest.mark.slow
def test_an_unbounded_stream_trains_on_two_ranks_and_workers_until_max_steps(ranks, tmp_path):
    (tmp_path / "stream_data.py").write_text(UNSIZED_STREAM_MODULE)
    config, run_dir = tmp_path / "c.yaml", tmp_path / "run"
    config.write_text(f"run_dir: {run_dir}\ndata: {{target: stream_data.unbounded, args: {{}}}}\n"
                      "trainer: {epochs: 1, batch_size: 4, num_workers: 2, max_steps: 7, eval_every_epochs: 0}\n"
                      "logging: {progress: false}\n")
    outputs = ranks.train(run_dir, config, 2, timeout=240)
    assert _epoch_steps(run_dir)[-1:] == [(0, 7)]
    assert "Unbounded of data.target stream_data.unbounded does not shard itself, so each of 2 ranks x 2 workers " \
           "reads the whole stream and keeps 1 sample in 4" in outputs[0]


@pytest.mark.slow
def test_uneven_shards_end_every_epoch_at_the_same_step_and_resume(ranks, tmp_path):
    """Rank 0 has 30 samples (8 batches of 4), rank 1 has 50 (13). Stop checks every 2 steps: rank 0
    runs out at step 9 and pads, votes at the check of step 10, every rank reads the vote at step 12
    and ends epoch 0 there; epoch 1 likewise ends at 24. Cut at step 10 (rank 0 padding, its data all
    read), the resumed run: rank 0 has no batch left, pads with one borrowed from rank 1 from step 11,
    votes at 12, and epoch 0 ends at 14, then epoch 1 at 26."""
    (tmp_path / "stream_data.py").write_text(UNSIZED_STREAM_MODULE)
    run_dir = tmp_path / "run"

    def config(name, *more):
        path = tmp_path / name
        path.write_text(f"run_dir: {run_dir}\ndata: {{target: stream_data.uneven, args: {{lengths: [30, 50]}}}}\n"
                        "trainer: {epochs: 2, batch_size: 4, eval_every_epochs: 0" + "".join(more) + "}\n"
                        "checkpoint: {stop_check_every: 2}\nlogging: {progress: false}\n")
        return path

    ranks.train(run_dir, config("whole.yaml"), 2, timeout=240)
    assert _epoch_steps(run_dir) == [(0, 12), (1, 24)]
    from ddpx.rank.checkpoint_files import load_file

    last = load_file(run_dir / "checkpoints" / "step-000000024.pt")
    trained = [rank["plugins"]["sampler"]["stream"]["consumed"] for rank in last["ranks"]]
    assert trained == [8, 12]  # epoch 1: rank 0 all of its 8 batches (then 4 padding steps), rank 1 12 of 13

    import shutil

    shutil.rmtree(run_dir)
    ranks.train(run_dir, config("cut.yaml", ", max_steps: 10"), 2, timeout=240)
    outputs = ranks.train(run_dir, config("rest.yaml"), 2, timeout=240)
    assert _epoch_steps(run_dir)[-2:] == [(0, 14), (1, 26)]
    assert "epoch 0's stream is read again from its start and each rank skips the batches it already trained " \
           "(rank 0: 8), not trained again" in outputs[0]


def _stream_end_worker(rank, world_size):
    """StreamEnd on 2 gloo ranks with a stand-in trainer: who has a batch, what a rank without one pads
    with, an epoch no rank has data for, and a run without stop checks."""
    import logging
    from types import SimpleNamespace

    from ddpx.train.stopping import StopAgreement
    from ddpx.train.stream_end import StreamEnd

    trainer = SimpleNamespace(global_step=5, epoch=2, world_size=world_size, rank=rank, is_main=rank == 0,
                              num_batches=sys.maxsize, epoch_batches=4,
                              device=torch.device("cpu"), config=SimpleNamespace(data=SimpleNamespace(target="m.f")),
                              log=logging.getLogger("stream-end-test"))
    trainer.stop_agreement = StopAgreement(trainer, 2, 1.0, 20.0)
    result = {}
    end = StreamEnd(trainer)  # rank 0's shard is empty (or all read before a resume)
    batches = list(end.start(iter([] if rank == 0 else ["b1", "b2"])))
    result["batches"], result["padding"] = batches, end.padding
    result["passes"] = end.padding_passes(1, 3)
    result["voted"], result["num_batches"] = trainer.stop_agreement.data_ended, trainer.num_batches
    nobody = StreamEnd(trainer)
    result["nobody"] = (list(nobody.start(iter([]))), trainer.num_batches)
    trainer.stop_agreement = None
    try:
        StreamEnd(trainer).start(iter(["b"]))
    except DdpxError as exc:
        result["without_checks"] = str(exc)
    return result


def test_a_rank_without_data_pads_with_a_borrowed_batch_and_an_epoch_without_data_ends_at_once(ranks):
    r0, r1 = ranks.call(_stream_end_worker, 2, timeout=120)
    assert (r0["batches"], r1["batches"]) == ([], ["b1", "b2"])
    assert r0["padding"] == r1["padding"] == "b1"  # rank 1's first batch: rank 0 pads with it
    assert r0["passes"] == 2 and r0["voted"]  # fills the window, voted at the next stop check
    assert r0["num_batches"] == sys.maxsize  # the epoch goes on until the ranks read the vote
    assert r0["nobody"] == r1["nobody"] == ([], 4)  # no rank has data: the epoch ends after the 4 trained
    assert r0["without_checks"] == r1["without_checks"] == (
        "the training stream of data.target m.f has no __len__, so the ranks agree on its end at the checkpoint "
        "plugin's stop checks, but that plugin is not loaded; remove checkpoint from plugins.block or give the "
        "data set a __len__")
