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


# ---------------------------------------------------------------- the device audit
def _tiny_pipeline(tmp_path) -> None:
    """The tiny pipeline's pieces on synthetic inputs: calibration moments with a feature sample, selection, the
    ridge and a factored fit, the MLP map, save/load, transfer and the target on the mapped cache, the content
    controls, selective recompute, the gate's signals and thresholds, batching, and the serving helpers."""
    import kvtransfer as kt
    from kvtransfer.core.gate import decide, fit_thresholds
    from kvtransfer.core.mapper import FactoredMapper, load_mapper
    from kvtransfer.core.recompute import selective_recompute
    from kvtransfer.core.signals import SIGNALS, request_signals
    from kvtransfer.eval.decode import pad
    from kvtransfer.maps.controls import calibration_means, mean_map, wrong_contexts
    from kvtransfer.maps.families import fit_family
    from kvtransfer.maps.mlp import FeatureSampler, fit_mlp
    from kvtransfer.serve import paged
    from kvtransfer.serve.hf import prefill_layers
    from tiny_models import random_ids, tiny_model

    source = tiny_model("qwen3", layers=3, name="audit-source")
    target = tiny_model("llama", layers=2, seed=1, name="audit-target")
    sampler = FeatureSampler(64, n_batches=4, seed=0)
    calib = kt.collect_moments(source, target, random_ids(40, 32, seed=1), stride=2, batch_size=8,
                               heldout_fraction=0.2, feature_sink=sampler)
    r2 = kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=8)
    selected = kt.select_topk(r2["train"], 2)
    fit = kt.fit_ridge(calib.train, selected, heldout=calib.heldout, head_dim=8)
    mapper = kt.Mapper.from_ridge(fit, source, target, calibration=calib.train.info)
    family = fit_family(calib.train, selected, n_kv_s=2, d_s=8, n_kv_t=2, support="head_local", rank=2,
                        heldout=calib.heldout)
    factored = FactoredMapper.from_family(family, source, target, calibration=calib.train.info)
    mlp = fit_mlp(sampler.tensors(), selected, source, target, source_width=16, target_heads=2, hidden=8, epochs=1,
                  batch_tokens=32)
    mapper = load_mapper(mapper.save(tmp_path / "map"), source, target)

    ids, mask = pad([[1, 5, 9, 12, 7, 3, 8, 4, 6, 2], [1, 4, 4, 9, 11, 13, 2]], 0, "left", "cpu")
    cache = kt.prefill(source, ids, mask)
    for m in (mapper, factored, mlp):
        kt.transfer(cache, m, source, target, attention_mask=mask, input_ids=ids, native_sink=1, as_layers=True)
    mapped = kt.transfer(cache, mapper, source, target, attention_mask=mask, input_ids=ids, native_sink=1,
                         as_layers=True)
    kt.forward_on_cache(target, mapped, mask, random_ids(2, 3, seed=3))

    mean_x, mean_y = calibration_means(calib.train, mapper)
    mean_map(mapper, mean_y)
    random_map(mapper, mean_x, mean_y, seed=0)
    wrong_contexts(ids.tolist(), [1], seed=0)

    for select in ("deviation", "random", "recent"):
        selective_recompute(target, ids, mapped, 0.4, select=select, attention_mask=mask, native_sink=1)
    signals = request_signals(target, mapped, ids, mask, tail=3, start_ids=[1], native_sink=1, names=list(SIGNALS))
    thresholds = fit_thresholds(signals["tail_kv"].tolist() + [0.1, 0.2], recompute_rate=0.3, full_rate=0.2,
                                fraction=0.5)
    decide(signals["tail_kv"][0], thresholds)

    paged.slot_mapping([3, 0, 2], 4, 2, 10)
    prefill_layers(target, [1, 5, 9, 12])


def test_the_tiny_pipeline_creates_no_tensor_without_a_device_or_a_reason(tmp_path):
    audit = DeviceAudit()
    with audit:
        _tiny_pipeline(tmp_path)
    assert audit.calls > 50, f"the audit saw only {audit.calls} factory calls from kvtransfer: did it run?"
    assert not audit.findings, ("tensor factories called from kvtransfer without a device: pass device=<the device "
                                "of the tensors the result meets>, or end the call's first line with "
                                f"`# device: <reason>`:\n{audit.report()}")


def test_the_audit_flags_a_deviceless_factory_and_a_generator_on_another_device(tmp_path):
    import importlib.util

    (tmp_path / "mod.py").write_text(
        "import torch\n"
        "def bare(): return torch.zeros(3)\n"
        "def placed(x): return torch.zeros(3, device=x.device)\n"
        "def reasoned(): return torch.arange(3)  # device: host-side positions\n"
        "def like(x): return torch.zeros_like(x)\n"
        "def spread(): return torch.tensor(\n"
        "    [1, 2])  # device: an annotation goes on the call's first line\n"
        "def drawn(g): return torch.randn(3, device='meta', generator=g)\n")
    spec = importlib.util.spec_from_file_location("audit_probe", tmp_path / "mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    outside = torch.zeros(2)   # this test file is outside the audited package: never flagged
    audit = DeviceAudit(package=tmp_path)
    with audit:
        torch.ones(2)
        mod.bare()
        mod.placed(outside)
        mod.reasoned()
        mod.like(outside)
        mod.spread()
        mod.drawn(torch.Generator())   # a meta tensor takes no values: the mismatch is the audit's to see
    found = [(f.line, f.call, f.problem) for f in audit.findings]
    assert found == [(2, "zeros", "names no device"), (6, "tensor", "names no device"),
                     (8, "randn", "draws with a cpu Generator into a meta tensor")]
    assert audit.calls == 5   # torch.ones above ran from this file: not the package's, not counted
