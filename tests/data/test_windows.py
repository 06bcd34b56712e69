"""vit_ct.data.transforms.windows against hand-computed values."""

import numpy as np
import pytest
import torch

from vit_ct.data.transforms.windows import WINDOW_PRESETS, parse_windows, stack_windows, window_hu


def test_presets_are_the_head_ct_ones():
    assert WINDOW_PRESETS == {"brain": (40, 80), "subdural": (80, 200), "bone": (600, 2800), "stroke": (32, 8)}


def test_window_hu_brain_by_hand():
    # brain 40/80 spans 0..80 HU: air and bone clip, blood at 60 HU sits at 0.75, water at 0.
    hu = np.array([-1000.0, 0.0, 20.0, 40.0, 60.0, 80.0, 1500.0], dtype=np.float32)
    expected = np.array([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0], dtype=np.float32)
    out = window_hu(hu, 40, 80)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, atol=1e-7)


def test_window_hu_torch_matches_numpy_and_keeps_device_dtype():
    hu = torch.tensor([[-50.0, 0.0], [100.0, 250.0]])
    # subdural 80/200 spans -20..180 HU
    expected = torch.tensor([[0.0, 0.1], [0.6, 1.0]])
    out = window_hu(hu, 80, 200)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    assert window_hu(hu.double(), 80, 200).dtype == torch.float64
    assert window_hu(torch.tensor([0, 40]), 40, 80).dtype == torch.float32  # integer HU -> float
    np.testing.assert_allclose(window_hu(hu.numpy(), 80, 200), expected.numpy(), atol=1e-6)


def test_window_hu_integer_numpy_and_bad_width():
    np.testing.assert_allclose(window_hu(np.array([-800, 600, 2000], dtype=np.int16), 600, 2800), [0.0, 0.5, 1.0])
    for width in (0, -10):
        with pytest.raises(ValueError, match="width must be > 0"):
            window_hu(np.zeros(3), 40, width)


def test_parse_windows_forms():
    assert parse_windows("brain") == [(40.0, 80.0)]
    assert parse_windows("Bone") == [(600.0, 2800.0)]
    assert parse_windows((40, 80)) == [(40.0, 80.0)]
    assert parse_windows(["brain", "subdural", "bone"]) == [(40.0, 80.0), (80.0, 200.0), (600.0, 2800.0)]
    assert parse_windows(["stroke", [50, 100], (0.5, 10.0)]) == [(32.0, 8.0), (50.0, 100.0), (0.5, 10.0)]


@pytest.mark.parametrize(
    ("windows", "named"),
    [
        ("lung", "'lung'"),
        (["brain", "liver"], "'liver'"),
        ([(40, 0)], "(40, 0)"),
        ((40, -5), "(40, -5)"),
        ([(40, 80, 3)], "(40, 80, 3)"),
        ([], "[]"),
        (42, "42"),
        ([True, 3], "True"),
        ([None], "None"),
    ],
)
def test_parse_windows_errors_name_the_value(windows, named):
    with pytest.raises(ValueError) as error:
        parse_windows(windows)
    assert named in str(error.value)


def test_stack_windows_numpy_and_torch():
    hu = np.array([[0.0, 40.0], [80.0, 1300.0]], dtype=np.float32)
    expected = np.array(
        [
            [[0.0, 0.5], [1.0, 1.0]],  # brain 0..80
            [[0.1, 0.3], [0.5, 1.0]],  # subdural -20..180
            [[800 / 2800, 840 / 2800], [880 / 2800, 2100 / 2800]],  # bone -800..2000
        ],
        dtype=np.float32,
    )
    out = stack_windows(hu, ["brain", "subdural", "bone"])
    assert out.shape == (3, 2, 2) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, atol=1e-6)
    out_t = stack_windows(torch.from_numpy(hu), ["brain", "subdural", "bone"])
    assert out_t.shape == (3, 2, 2) and out_t.dtype == torch.float32
    np.testing.assert_allclose(out_t.numpy(), expected, atol=1e-6)
    assert stack_windows(hu, "brain").shape == (1, 2, 2)
    with pytest.raises(ValueError, match="2-D"):
        stack_windows(np.zeros((1, 2, 2)), "brain")
