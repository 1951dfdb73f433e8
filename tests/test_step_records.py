"""The training step gives the same numbers as before its rewrite into ``Trainer.train_step``.

``tests/fixtures/step_records.json`` holds the epoch records of ``ddpx train`` on
the digits default, written by the code before the rewrite (9b8e6f0, the step
spread over step_hooks, the default hooks, amp and accumulation). The same runs now must give
the same records on CPU: training loss, evaluation metrics, steps, AMP's skips and scale.
Only the wall-clock fields differ between runs.

One difference was intended: 9b8e6f0 reported an accumulated micro-batch's loss as
``(loss / window) * window``, a last-bit error in the epoch's short window of 3
micro-batches; the rewrite reports the loss itself. The accumulation run's records
were written by 9b8e6f0 with that report fixed (the fixture says how); its weights,
hence its evaluation metrics, were bit-identical with and without the fix.

Another kind of CPU rounds float32 losses and gradients differently in the last bit
with the same code and torch, so the records are compared as every stored number is
(tests/stored_numbers.py): floats within 1e-6 relative, steps, skip counts and keys
exactly. One stored set serves every CPU where the CPUs agree within that: the default
run's records (an AVX-512 Xeon's were within 8.3e-8 of these). Through fp16 AMP and int8
compression a last-bit difference grows into a rounding quantum, up to 1e-5 relative by
epoch 2 on that Xeon: for those runs ``other_cpus`` keeps the Xeon's records (written by
a commit whose records equal 9b8e6f0's where those were written), and a run must match
one stored set. A CPU of a third kind passes those two runs within 1e-4 of a set, with a
warning that prints its records to store (CI runs on whatever machine a session gets).
"""

import copy
import json
import pathlib
import shutil

import pytest

from stored_numbers import REL_TOL, UNKNOWN_CPU_REL, UnknownCpuWarning, assert_matches_one_of, differences

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "step_records.json"
# The runs: name -> overrides of the digits default (2 ranks, 23 micro-batches an epoch).
RUNS = {
    "default": ["trainer.epochs=3"],
    # accumulation windows of 4, 4, ..., 3 (the epoch's short last window), fp16 AMP's
    # GradScaler, and the int8 comm hook on the all-reduced steps
    "amp_fp16_accumulation_int8": ["trainer.epochs=3", "amp.enabled=true", "amp.dtype=fp16",
                                   "accumulation.steps=4", "comm_hook.name=int8"],
}
WALL_CLOCK = ("time", "elapsed_s", "samples_per_s", "epoch_s")
# Where a CPU whose records are not stored may land (tests/stored_numbers.py): the runs through fp16
# and int8, whose rounding compounds; the fp32 default run has one set for every CPU.
UNKNOWN_CPU = {"default": None, "amp_fp16_accumulation_int8": UNKNOWN_CPU_REL, "resume": UNKNOWN_CPU_REL}


def epoch_records(run_dir: pathlib.Path) -> list:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in records if r.get("kind") == "epoch"]


def expected(stored: dict, name: str) -> list:
    """Every stored record set of run ``name``: the first CPU's, and another CPU's where its
    records differ from those by more than the tolerance."""
    if name == "resume":
        return [[stored["resume"]["epoch_2"]],
                *([cpu["resume_epoch_2"]] for cpu in stored["other_cpus"] if "resume_epoch_2" in cpu)]
    return [stored["runs"][name]["records"],
            *(cpu["runs"][name] for cpu in stored["other_cpus"] if name in cpu["runs"])]


def train(ranks, tmp_path, name: str) -> list:
    run_dir = tmp_path / name
    # int8's block_size auto is 256 with the digits' SGD: what the records were made with
    rc, out, err = ranks.cli(["train", *RUNS[name], "logging.progress=false", f"run_dir={run_dir}",
                              "--nproc-per-node", "2"], timeout=240, cwd=tmp_path)
    assert rc == 0, err
    return epoch_records(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_epoch_records_equal_those_before_the_step_rewrite(ranks, tmp_path, name):
    stored = json.loads(FIXTURE.read_text())
    assert stored["runs"][name]["overrides"] == RUNS[name]
    assert_matches_one_of(train(ranks, tmp_path, name), expected(stored, name), unknown_cpu_rel=UNKNOWN_CPU[name])


CHECKPOINT = FIXTURE.parent / "checkpoint-9b8e6f0"  # every plugin's state in the layout before the rewrite


@pytest.mark.slow
def test_a_checkpoint_written_before_the_rewrite_resumes_exactly(ranks, tmp_path):
    """The end of epoch 1 of an fp16 + accumulation + int8 + EMA + early-stopping run,
    saved by 9b8e6f0, resumed now: epoch 2 must equal the uninterrupted run's (the
    GradScaler, the sampler position, the EMA, the early-stopping counters and the RNG
    states all came back), floats within the stored numbers' tolerance."""
    fixture = json.loads(FIXTURE.read_text())
    stored = fixture["resume"]
    run_dir = tmp_path / "run"
    shutil.copytree(CHECKPOINT, run_dir / "checkpoints")
    rc, out, err = ranks.cli(["train", *stored["overrides"], "trainer.epochs=3", "logging.progress=false",
                              f"run_dir={run_dir}", "--nproc-per-node", "2"], timeout=240, cwd=tmp_path)
    assert rc == 0, err
    assert "step-000000012.pt (epoch 2, step 12)" in err
    for fresh_start in ("starting the hook fresh", "without an EMA", "starting its patience afresh"):
        assert fresh_start not in err
    assert_matches_one_of(epoch_records(run_dir), expected(fixture, "resume"), unknown_cpu_rel=UNKNOWN_CPU["resume"])


# ---------------------------------------------------------------- the comparison itself (no process)


def _moved(records: list, index: int, key: str, value) -> list:
    changed = copy.deepcopy(records)
    changed[index][key] = value
    return changed


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_tolerance_still_catches_a_change_of_behaviour(name):
    """Last-bit rounding passes; any float moved by 1e-5 relative (10x the tolerance), a step or
    skip count, a key or a record that changes fails."""
    stored = json.loads(FIXTURE.read_text())
    records = stored["runs"][name]["records"]
    sets = expected(stored, name)
    assert_matches_one_of(copy.deepcopy(records), sets)
    floats = [(i, key) for i, r in enumerate(records) for key, v in r.items() if isinstance(v, float)]
    assert len(floats) >= 9  # loss, eval_loss, accuracy (and amp_scale) of 3 epochs
    for i, key in floats:
        value = records[i][key]
        assert_matches_one_of(_moved(records, i, key, value * (1 + 3e-8)), sets)  # rounding: about 1e-8
        for moved in (value * (1 + 1e-5), value * (1 - 1e-5), float("nan")):
            with pytest.raises(AssertionError, match=rf"\[{i}\]\.{key}: "):
                assert_matches_one_of(_moved(records, i, key, moved), sets)
    counts = [(i, key) for i, r in enumerate(records) for key, v in r.items() if type(v) is int]
    assert ("step" in {key for _, key in counts}) and len(counts) >= 6
    for i, key in counts:
        for changed in (records[i][key] + 1, float(records[i][key])):  # another count; a float where an int was
            with pytest.raises(AssertionError, match=rf"\[{i}\]\.{key}: "):
                assert_matches_one_of(_moved(records, i, key, changed), sets)
    with pytest.raises(AssertionError, match=r"\[2\]: keys"):
        assert_matches_one_of(_moved(records, 2, "ema_accuracy", 0.5), sets)
    with pytest.raises(AssertionError, match=r"\[0\]: keys"):
        assert_matches_one_of([{k: v for k, v in r.items() if k != "eval_loss"} for r in records], sets)
    with pytest.raises(AssertionError, match="2 items, stored 3"):
        assert_matches_one_of(records[:2], sets)


def test_a_cpu_whose_records_are_not_stored_passes_with_a_warning_but_not_a_larger_change():
    """A quantized run on a CPU not stored yet lands within 1e-4 of a stored set (two kinds of CPU
    differ by up to 1e-5): it passes and prints its records to store; 1e-3 (a changed step path:
    a wrong accumulation divisor moves the loss by far more) still fails."""
    stored = json.loads(FIXTURE.read_text())
    records = stored["runs"]["amp_fp16_accumulation_int8"]["records"]
    sets = expected(stored, "amp_fp16_accumulation_int8")
    other_cpu = _moved(records, 2, "eval_loss", records[2]["eval_loss"] * (1 + 3e-5))
    with pytest.warns(UnknownCpuWarning, match=r"store these in the fixture's other_cpus: \[\{"):
        assert_matches_one_of(other_cpu, sets, unknown_cpu_rel=UNKNOWN_CPU_REL)
    with pytest.raises(AssertionError, match=r"\[2\]\.eval_loss: "):
        assert_matches_one_of(other_cpu, sets)  # without the allowance: the tolerance
    changed = _moved(records, 2, "eval_loss", records[2]["eval_loss"] * (1 + 1e-3))
    with pytest.raises(AssertionError, match=r"\[2\]\.eval_loss: "):
        assert_matches_one_of(changed, sets, unknown_cpu_rel=UNKNOWN_CPU_REL)
    assert UNKNOWN_CPU["default"] is None  # fp32: every CPU within 1e-6 of the one set


def test_the_comparison_of_plain_values():
    assert differences({"a": [1, 2.0, "x", None, True]}, {"a": [1, 2.0 * (1 + 5e-7), "x", None, True]}) == []
    assert differences(0.0, 0.0) == [] and differences(float("nan"), float("nan")) == []
    assert differences(1e-30, 0.0)  # a stored zero stays zero
    assert differences(1 + 2e-6, 1.0) == ["the value: 1.000002, stored 1.0 (2e-06 relative; tolerance 1e-06)"]
    assert differences(True, 1) and differences(1, True) and differences(1, 1.0) and differences("1", 1)
    assert differences(1.01, 1.0, rel=0.02) == []


def test_another_cpus_records_are_kept_only_where_they_differ_beyond_the_tolerance():
    """An ``other_cpus`` set within the tolerance of the first one is redundant; one that differs
    beyond it differs in floats only (the same steps, skips, keys), by rounding."""
    stored = json.loads(FIXTURE.read_text())
    kept = 0
    for name in [*RUNS, "resume"]:
        first, *others = expected(stored, name)
        for other in others:
            kept += 1
            assert differences(other, first), f"{name}: another CPU's records within {REL_TOL:g} of the first's"
            assert differences(other, first, rel=1e-4) == [], name
    assert kept == 2  # amp_fp16_accumulation_int8 and resume; the default run has one set
