"""Records of timed calls: values at secret positions, read in one process and checked in another."""

import pytest
import torch

from cuda_agent.evaluate.protocol import messages as p
from cuda_agent.evaluate.protocol.records import (OUTPUT_VALUES, Recorder, compare_record, positions, same_outputs, same_samples,
                                         sample_output)


def _record(output, inputs, probe=11, index=3):
    recorder = Recorder(probe)
    recorder.record(index, output, inputs)
    (fields,) = recorder.finish()
    return p.CallRecord.from_reply(fields)


def test_positions_are_a_function_of_the_probe_and_distinct():
    first = positions(5, "output", 0, 10_000, 16)
    assert first == positions(5, "output", 0, 10_000, 16)
    assert first != positions(6, "output", 0, 10_000, 16)
    assert len(set(first)) == 16 and all(0 <= i < 10_000 for i in first)
    assert positions(5, "output", 0, 3, 16) == [0, 1, 2] and positions(5, "output", 0, 0, 16) == []


def test_a_right_output_passes_even_when_strided_and_mixed():
    x = torch.randn(64, 33)
    expected = (x.t() * 2, torch.arange(7), torch.tensor(1.5), torch.randn(5, dtype=torch.complex64))
    actual = (x.t().contiguous() * 2, torch.arange(7), torch.tensor(1.5), expected[3].clone())
    record = _record(actual, [x])
    assert record.index == 3 and len(record.outputs[0].values) == OUTPUT_VALUES
    assert compare_record(expected, [x], record, 11, 1e-5, 1e-5, scale=True)["ok"]


def test_a_partly_wrong_output_fails_and_names_the_leaf():
    x = torch.randn(4096)
    wrong = x * 2
    wrong[::2] = 0.0  # half the work skipped
    verdict = compare_record(x * 2, [x], _record(wrong, [x]), 11, 1e-5, 1e-5, scale=True)
    assert not verdict["ok"] and verdict["rule"] is None and "output[0]" in verdict["reason"]


def test_an_input_changed_by_the_call_is_input_mutation():
    x = torch.randn(4096)
    y = x * 2
    changed = x.clone()
    changed.zero_()
    verdict = compare_record(y, [x], _record(y, [changed]), 11, 1e-5, 1e-5, scale=True)
    assert verdict["rule"] == "input-mutation"


@pytest.mark.parametrize("actual, reason", [
    (torch.zeros(4096, dtype=torch.float64), "float64"),
    (torch.zeros(64, 64), "[64, 64]"),
    ((torch.zeros(4096), torch.zeros(1)), "2 output tensor(s)"),
])
def test_structure_mismatches_fail(actual, reason):
    x = torch.randn(4096)
    verdict = compare_record(x * 2, [x], _record(actual, [x]), 11, 1e-5, 1e-5, scale=False)
    assert not verdict["ok"] and reason in verdict["reason"]


def test_a_record_read_with_another_probe_does_not_match():
    x = torch.randn(4096)
    verdict = compare_record(x * 2, [x], _record(x * 2, [x], probe=12), 11, 1e-5, 1e-5, scale=False)
    assert not verdict["ok"]


def test_a_primed_recorder_reads_the_same_values_and_carries_its_shapes():
    x, y = torch.randn(8, 16), torch.randn(3, 5, dtype=torch.complex64)
    first = Recorder(11)
    first.record(0, (x * 2, y), [x])
    assert sorted(key[0] for key in first.keys()) == ["input", "output", "output"]
    primed = Recorder(12)
    primed.prime(first.keys())
    plain = Recorder(12)
    for recorder in (primed, plain):
        recorder.record(5, (x * 2, y), [x])
    assert primed.finish() == plain.finish()
    first.finish()
    # Another round's probe reads other positions: priming builds the indices for the new probe.
    assert positions(11, "output", 0, x.numel(), OUTPUT_VALUES) != positions(12, "output", 0, x.numel(), OUTPUT_VALUES)


def _samples(output, probe=11):
    return [p.LeafSample.from_reply(leaf) for leaf in sample_output(output, probe)]


def test_an_output_computed_again_samples_as_its_record_bit_for_bit():
    x = torch.randn(4096)
    y = torch.sigmoid(x) * x
    record = _record((y, torch.arange(5)), [x])
    assert same_samples(_samples((y.clone(), torch.arange(5))), record.outputs)
    # Within any tolerance, but not the same bits: x / (1 + exp(-x)) rounds otherwise in about half the elements.
    other = x / (1 + torch.exp(-x))
    assert torch.allclose(other, y) and not same_samples(_samples((other, torch.arange(5))), record.outputs)
    assert not same_samples(_samples((y,)), record.outputs)  # a leaf fewer
    assert not same_samples(_samples((y, torch.arange(5)), probe=12), record.outputs)  # other positions


def test_nan_samples_match_nan_and_nothing_else():
    y = torch.full((64,), float("nan"))
    assert same_samples(_samples(y), _samples(y.clone()))
    assert not same_samples(_samples(y), _samples(torch.zeros(64)))


def test_two_runs_are_compared_in_every_element_a_piece_at_a_time(monkeypatch):
    monkeypatch.setattr("cuda_agent.tensors.PIECE", 97)
    y = torch.randn(64, 33)
    y[3, 4] = float("nan")
    assert same_outputs((y, torch.arange(5)), (y.clone(), torch.arange(5)))
    one_bit = y.clone()
    one_bit[60, 30] = torch.nextafter(one_bit[60, 30], torch.tensor(1e30))  # in the last piece
    assert not same_outputs(y, one_bit)
    assert same_outputs(y.t(), y.t().contiguous())  # strided against contiguous, NaN included
    assert not same_outputs(y, y.reshape(33, 64)) and not same_outputs((y,), (y, y))
