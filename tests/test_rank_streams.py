"""A random stream per rank: identical initial weights, different draws per rank, the same in every
run, restored exactly on resume; per-worker and per-sample seeds (issue 28, finding 2)."""

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddpx.data.sampler import ResumableDistributedBatchSampler
from ddpx.data.seeded import SeededDataset
from ddpx.rank.seeding import derive_seed, seed_rank


class Noisy(Dataset):
    """A sample is its index plus a random 'augmentation' from the global torch generator."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return torch.tensor([float(index), torch.rand(()).item(), random.random()])


def test_derived_seeds_differ_per_part_and_repeat():
    assert derive_seed(0, 0) == derive_seed(0, 0)
    assert len({derive_seed(0, r) for r in range(64)}) == 64
    assert derive_seed(0, 1) != derive_seed(1, 0) and 0 <= derive_seed(5, 3) < 2**63


def test_rank_streams_differ_across_ranks_and_repeat_across_runs():
    draws = {}
    for rank in (0, 1, 0):
        seed_rank(7, rank)
        draws.setdefault(rank, []).append((torch.rand(4), random.random()))
    (a0, a1), (b0,) = draws[0], draws[1]
    assert torch.equal(a0[0], a1[0]) and a0[1] == a1[1]  # rank 0 twice: the same
    assert not torch.equal(a0[0], b0[0]) and a0[1] != b0[1]  # rank 0 vs rank 1: different


def _samples(world_size, per_sample, epoch=0, workers=0):
    """Every sample a world of ``world_size`` ranks loads in ``epoch``, by index."""
    out = {}
    for rank in range(world_size):
        seed_rank(3, rank)
        sampler = ResumableDistributedBatchSampler(24, 4, rank, world_size, seed=3, with_epoch=True)
        sampler.set_epoch(epoch)
        loader = DataLoader(SeededDataset(Noisy(), 3, rank, per_sample), batch_sampler=sampler, num_workers=workers)
        for batch in loader:
            for row in batch:
                out[int(row[0])] = (row[1].item(), row[2].item())
    return out


def test_seed_per_sample_makes_the_data_independent_of_the_world_size():
    one, two, three = _samples(1, True), _samples(2, True), _samples(3, True)
    assert len(one) == 24 and one == two == three
    assert _samples(2, True, epoch=1) != two  # a new epoch, new augmentations
    assert _samples(1, False) != _samples(2, False)  # without it the ranks' streams differ


def test_seed_per_sample_leaves_the_rank_stream_alone():
    def after_an_epoch(dataset):
        seed_rank(3, 0)
        sampler = ResumableDistributedBatchSampler(24, 4, 0, 1, seed=3, with_epoch=True)
        list(DataLoader(SeededDataset(dataset, 3, 0, True), batch_sampler=sampler))  # the loader draws its own seed
        return torch.rand(3)

    assert torch.equal(after_an_epoch(Noisy()), after_an_epoch(list(range(24))))


@pytest.mark.parametrize("per_sample", [False, True])
def test_a_batch_fetch_gives_the_samples_of_single_fetches(per_sample):
    keys = [(1, i) for i in (5, 0, 17, 3)]

    def fetch(batched):
        seed_rank(3, 0)
        data = SeededDataset(Noisy(), 3, 0, per_sample)
        samples = data.__getitems__(keys) if batched else [data[key] for key in keys]
        return torch.stack(samples), torch.rand(2)  # and the rank's stream after them

    (batched, after_batched), (single, after_single) = fetch(True), fetch(False)
    assert batched[:, 0].tolist() == [5.0, 0.0, 17.0, 3.0]
    assert torch.equal(batched, single) and torch.equal(after_batched, after_single)


@pytest.mark.slow
def test_worker_seeds_depend_on_rank_worker_and_epoch():
    a = _samples(2, False, workers=2)
    assert a == _samples(2, False, workers=2)  # the same in every run
    values = [v for v in a.values()]
    assert len(set(values)) == len(values)  # no two workers or ranks draw alike
    assert _samples(2, False, epoch=1, workers=2) != a


DROPOUT_CONFIG = """
model: {{target: rank_models.DropoutMLP, args: {{}}}}
run_dir: {run_dir}
trainer: {{epochs: 2, batch_size: 16, max_steps: {max_steps}, eval_every_epochs: 0}}
checkpoint: {{every_steps: 5, async_write: false}}
logging: {{progress: false}}
"""

MODEL = '''
import os, torch
class DropoutMLP(torch.nn.Module):
    """Records the dropout mask's sum and a torch.rand draw at every forward, per rank."""
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 10))
        self.record = os.path.join(os.environ["RECORD_DIR"], f"rank{os.environ.get('RANK', '0')}.txt")
    def forward(self, x):
        if self.training:
            with open(self.record, "a") as f:
                f.write(f"{torch.rand(()).item():.8f}\\n")
        return self.net(x)
'''


@pytest.mark.slow
def test_two_ranks_draw_differently_repeat_across_runs_and_resume_exactly(ranks, tmp_path):
    (tmp_path / "rank_models.py").write_text(MODEL)

    def run(name, max_steps, run_dir=None):
        records = tmp_path / name
        records.mkdir(exist_ok=True)
        config = tmp_path / f"{name}.yaml"
        config.write_text(DROPOUT_CONFIG.format(run_dir=run_dir or tmp_path / f"run-{name}", max_steps=max_steps))
        ranks.train(tmp_path / f"run-{name}", config, 2, timeout=240, env={"RECORD_DIR": str(records)})
        return [(records / f"rank{r}.txt").read_text().split() for r in range(2)]

    first = run("a", 20)
    assert all(x != y for x, y in zip(first[0], first[1]))  # rank 0 and 1 never draw alike
    # a second run repeats the first's draws (its 10 steps: a 20-step repeat was a fourth launch, and
    # the resumed half below draws steps 11-20 as the first run did), then resumes to draw the rest
    stopped = run("c", 10, tmp_path / "run-c")
    assert [len(s) for s in stopped] == [len(f) // 2 for f in first] and all(stopped)
    for rank in range(2):
        assert stopped[rank] == first[rank][:len(stopped[rank])]  # identical across two runs
    resumed = run("d", 20, tmp_path / "run-c")  # resumes at step 10 from the same run_dir
    for rank in range(2):
        assert stopped[rank] + resumed[rank] == first[rank]  # exactly the uninterrupted stream
