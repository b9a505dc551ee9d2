"""Device discipline checked on a CPU: simulated-CUDA tensors and the device audit.

PyTorch's FakeTensorMode places tensors on "cuda" without a GPU (shapes and devices only) and raises
FakeTensorDeviceMismatchError where a real GPU would raise "Expected all tensors to be on the same device". On a
CPU-only build it cannot index or slice a fake CUDA tensor, copy a real tensor to "cuda", make a CUDA Generator or
read `.item()`, so inputs are built inside the mode with `torch.empty(..., device="cuda")` and only code free of
those runs under it. The device audit (kvtransfer.core.device_audit.DeviceAudit) covers the rest: it runs the
tiny pipeline's pieces on the CPU and records every tensor factory they call without a device.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kvtransfer.core.device_audit import DeviceAudit
from kvtransfer.core.mapper import Mapper
from kvtransfer.maps.controls import random_map

CUDA = torch.device("cuda", 0)   # what FakeTensorMode reports for device="cuda"


def _fake_linear_map(n_t=2, k=3, width=4, q=8, head_dim=4):
    """(Mapper, mean_x [L, 2, p], mean_y [L, 2, q]) with weights and means on fake CUDA (call inside the mode)."""
    p = k * width
    mapper = Mapper(weight=torch.empty(n_t, 2, p, q, device="cuda"), bias=torch.empty(n_t, 2, q, device="cuda"),
                    selected_layers=torch.empty(n_t, k, dtype=torch.long, device="cpu"), source={},
                    target={"head_dim": head_dim})
    return mapper, torch.empty(n_t, 2, p, device="cuda"), torch.empty(n_t, 2, q, device="cuda")


def test_random_map_of_a_cuda_map_stays_on_cuda():
    # the eval stage moves the calibration means to the evaluation device; the control's random draw must meet
    # them there (it was drawn on the CPU and failed every GPU run's default pipeline)
    with FakeTensorMode():
        mapper, mean_x, mean_y = _fake_linear_map()
        control = random_map(mapper, mean_x, mean_y, seed=0)
        assert control.weight.device == CUDA and control.bias.device == CUDA
        assert control.weight.shape == mapper.weight.shape and control.bias.shape == mapper.bias.shape


def test_fake_cuda_tensors_catch_a_cross_device_einsum():
    # the premise of the test above: the simulated device raises where a GPU would
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with FakeTensorMode():
        x = torch.empty(2, 3, device="cuda")
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.einsum("ij,jk->ik", x, torch.empty(3, 4))
