"""ropekit bench: the quick CPU run end to end at tiny sizes, the GPU configuration and its report (from synthetic
records: the CPU machine has no GPU)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ropekit.bench import BenchConfig, format_report, run_bench
from ropekit.bench.cli import add_arguments, config_from_args, main
from ropekit.bench.core import VIT_PES_GPU
from ropekit.bench.measure import round_times
from ropekit.bench.report import evaluate_targets


def _tiny(**kw) -> BenchConfig:
    base = dict(rows=("none", "mixed", "fused kernel (mixed freqs)"), cases=("grid2d", "rgbd3d"), batch=1, heads=2,
                head_dim=8, grid=3, threads=1, vit=("tiny",), vit_pes=("axial",), vit_repeats=1, vit_batch=4,
                memory=False, max_spread=None)  # microsecond calls: a noisy spread must not refuse the rows here
    base.update(kw)
    return BenchConfig.quick_config(**base)


def test_quick_cpu_run_records_and_report():
    records = run_bench(_tiny(), log=lambda s: None)
    labels = {(r["label"], r["case"]) for r in records}
    assert ("mixed", "rgbd3d") in labels and ("axial", "vit-tiny") in labels
    # the Triton kernel row is for GPUs only: not selected on the CPU
    assert not any(r["kind"] == "kernel" for r in records)
    for r in records:
        assert r["device"] == "cpu" and r["dtype"] == "fp32"
        if r["kind"] == "pe":
            assert r["fwdbwd_ms"] > 0 and r["floor_fwdbwd_ms"] > 0
            assert r["x_floor"] == pytest.approx(r["fwdbwd_ms"] / r["floor_fwdbwd_ms"])
    vit = next(r for r in records if r["kind"] == "vit")
    assert vit["mode"] == "eager" and vit["x_absolute"] == pytest.approx(vit["step_ms"] / vit["absolute_step_ms"])
    report = format_report(records, command="ropekit bench --quick")
    assert "| mixed |" in report and "floor q*k" in report and "tiny x absolute" in report
    json.dumps(records)  # serialisable


def test_cli_quick_writes_json_and_markdown(tmp_path, capsys):
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    rc = main(["--quick", "--rows", "axial", "--cases", "grid2d", "--batch", "1", "--heads", "2", "--head-dim", "8",
               "--grid", "3", "--threads", "1", "--no-vit", "--no-memory", "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    recs = json.loads(out.read_text())
    # selecting an encoding selects its rows: the encoding alone and in a training layer
    assert [r["label"] for r in recs] == ["axial", "axial in training"] and recs[0]["device"] == "cpu"
    assert "python -m ropekit.bench --quick" in md.read_text()
    assert "| grid2d | axial |" in md.read_text().split("### In training")[1]


def test_report_records_the_cpu_allocator(monkeypatch):
    """The allocator's settings move CPU figures (page faults of fresh buffers): the report says which were used."""
    from ropekit.bench.measure import ALLOCATOR_VARIABLES, allocator_settings

    for var in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    assert allocator_settings() == "C library defaults"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert allocator_settings() == "MALLOC_MMAP_THRESHOLD_=33554432"
    records = run_bench(_tiny(rows=("none",), cases=("grid2d",), vit=()), log=lambda s: None)
    assert records and all(r["allocator"] == "MALLOC_MMAP_THRESHOLD_=33554432" for r in records)
    assert "CPU allocator: MALLOC_MMAP_THRESHOLD_=33554432" in format_report(records)


def test_training_rows_time_the_folded_work_and_the_layer():
    """A training row times what a folded encoding adds to one attention layer: its form, the merge into the
    projection, the rotation; the cayley row's ratio is the one its target reads."""
    records = run_bench(_tiny(rows=("cayley", "comrope-ld"), cases=("grid2d",), vit=(), head_dim=8, repeats=3),
                        log=lambda s: None)
    train = {r["label"]: r for r in records if r["kind"] == "train"}
    assert set(train) == {"cayley in training (folded)", "comrope-ld (b=8) in training (folded)"}
    for r in train.values():
        assert "skipped" not in r and r["fwdbwd_ms"] > 0 and r["fwd_ms"] > 0
        assert r["frac_sdpa"] == pytest.approx(r["fwdbwd_ms"] / r["sdpa_fwdbwd_ms"])
    targets = {(t["target"], t["case"]): t for t in evaluate_targets(records)}
    t = targets[("cayley in training (folded, per layer) fwd+bwd <= 10% of SDPA", "grid2d")]
    assert t["value"] == pytest.approx(train["cayley in training (folded)"]["frac_sdpa"])
    assert targets[("cayley alone (every token, unfolded) fwd+bwd <= 10% of SDPA", "grid2d")]["value"] is not None


def test_partial_results_are_reported_after_each_row():
    seen = []
    records = run_bench(_tiny(rows=("none", "axial"), cases=("grid2d",), vit=()), log=lambda s: None,
                        on_record=lambda recs: seen.append([r["label"] for r in recs]))
    assert seen == [["none"], ["none", "axial"], ["none", "axial", "axial in training"]]
    assert all("cpu" in r and "load_avg_end" in r for r in records)


def test_bad_vit_mode():
    with pytest.raises(ValueError, match="modes"):
        run_bench(_tiny(rows=("none",), cases=("grid2d",), vit_modes=("fast",)), log=lambda s: None)


def test_bad_compile_mode():
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        run_bench(_tiny(rows=("none",), cases=("grid2d",), vit=("tiny",), vit_modes=("compiled",),
                        compile_mode="fastest"), log=lambda s: None)


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_cuda_config_from_cli():
    cfg = config_from_args(_args(["--device", "cuda", "--dtype", "bf16"]))
    assert cfg.on_gpu and cfg.dtype == "bf16" and cfg.batch == 64 and cfg.vit == ("base",)
    assert cfg.vit_batch == 128 and cfg.compile and cfg.vit_pes == VIT_PES_GPU and cfg.timm
    cfg = config_from_args(_args(["--device", "cuda", "--vit-batch", "32", "--no-compile", "--no-timm", "--batch", "8",
                                  "--vit-pes", "axial"]))
    assert cfg.vit_batch == 32 and not cfg.compile and not cfg.timm and cfg.batch == 8 and cfg.vit_pes == ("axial",)
    cfg = config_from_args(_args(["--device", "cuda", "--vit-modes", "compiled"]))
    assert cfg.vit_modes == ("compiled",) and cfg.compile_mode == "default"
    cfg = config_from_args(_args(["--device", "cuda", "--vit-modes", "compiled", "--compile-mode", "reduce-overhead"]))
    assert cfg.compile_mode == "reduce-overhead"
    with pytest.raises(SystemExit):
        _args(["--compile-mode", "fastest"])
    cpu = config_from_args(_args([]))
    assert not cpu.on_gpu and cpu.dtype == "fp32" and cpu.batch == 8 and not cpu.compile


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_request_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        run_bench(_tiny(device="cuda"), log=lambda s: None)
    with pytest.raises(ValueError, match="dtype"):
        run_bench(_tiny(dtype="int8"), log=lambda s: None)


def test_round_times_interleaves_calls():
    calls = []
    times = round_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=2, warmup=1)
    assert calls == ["a", "b"] * 3 and len(times["a"]) == 2 and all(t >= 0 for t in times["b"])


def _gpu_records():
    meta = dict(device="cuda", dtype="bf16", gpu="NVIDIA H100 80GB HBM3", capability="9.0", cuda="12.8",
                triton="3.3.0", tf32_matmul=False, cpu="x", cpus=16, threads=2, torch="2.x", clock="cuda events")
    recs = []
    for case in ("grid2d", "rgbd3d"):
        for label, ms in (("axial", 0.25), ("mixed", 0.5), ("fused kernel (mixed freqs)", 0.22)):
            recs.append(dict(meta, kind="kernel" if "kernel" in label else "pe", label=label, pe="mixed", case=case,
                             batch=64, heads=12, tokens=196, head_dim=64, fwd_ms=ms / 3, fwdbwd_ms=ms,
                             fwdbwd_ms_min=ms, floor_fwdbwd_ms=0.2, floor_fwdbwd_ms_min=0.2, sdpa_fwdbwd_ms=0.43,
                             sdpa_fwdbwd_ms_min=0.43, none_fwdbwd_ms=0.1, x_none=ms / 0.1, x_floor=ms / 0.2,
                             frac_sdpa=ms / 0.43))
    for mode, ape in (("eager", 52.0), ("compiled", 45.0)):
        for label, ms in (("axial", ape * 1.02), ("cayley", ape * 1.2), ("timm vit_base_patch16_224", ape * 1.01)):
            recs.append(dict(meta, kind="vit", label=label, pe=label, case="vit-base", size="base", mode=mode,
                             batch=128, image_size=224, patch_size=16, tokens=196, step_ms=ms, step_ms_min=ms,
                             absolute_step_ms=ape, absolute_step_ms_min=ape, x_absolute=ms / ape))
    return recs


def test_gpu_report_and_targets():
    recs = _gpu_records()
    report = format_report(recs, command="ropekit bench --device cuda --dtype bf16")
    assert "GPU NVIDIA H100" in report and "floor q*c, k*c" in report and "bf16 (autocast)" in report
    assert "base compiled x absolute" in report and "| timm vit_base_patch16_224 |" in report
    assert "fused kernel (mixed freqs)" in report
    targets = {(t["target"], t["case"]): t for t in evaluate_targets(recs)}
    axial = targets[("axial fwd+bwd <= 1.5x floor (q*c, k*c)", "grid2d")]
    assert axial["met"] and axial["value"] == pytest.approx(1.25)
    assert targets[("mixed fwd+bwd <= 1.5x floor (q*c, k*c)", "grid2d")]["met"] is False
    assert targets[("ViT-B/16 step with axial <= 1.05x absolute embedding (compiled)", "vit-base")]["met"]
    assert targets[("ViT-B/16 step with cayley <= 1.05x absolute embedding (eager)", "vit-base")]["met"] is False
    timm = targets[("ropekit absolute-embedding ViT-B step <= timm's (eager)", "vit-base")]
    assert timm["met"] and timm["value"] == pytest.approx(1 / 1.01)
    assert targets[("ViT-B/16 step with circulant <= 1.05x absolute embedding (eager)", "vit-base")]["met"] is None


class _FakeGpu:
    """A GPU timeline in milliseconds: launches queue work behind what is queued, synchronisations make the host
    wait for it, events stamp the time the GPU reaches them -- enough to run ``_gpu_times`` without a GPU."""

    def __init__(self):
        self.host = 0.0
        self.free = 0.0  # when the GPU has finished everything queued so far

    def launch(self, ms: float, host_ms: float = 0.02) -> None:
        self.free = max(self.free, self.host) + ms
        self.host += host_ms

    def sync(self) -> None:
        self.host = max(self.host, self.free)


def _patch_fake_gpu(monkeypatch, gpu: _FakeGpu) -> None:
    import types

    import ropekit.bench.measure as measure

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = max(gpu.free, gpu.host)

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: gpu.sync())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: gpu.launch(cycles / 1000.0, host_ms=0.0))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: gpu.host / 1e3))
    monkeypatch.setitem(measure.CYCLES_PER_MS, 0, 1000.0)


def test_gpu_times_isolate_gpu_work_and_flag_a_synchronising_op(monkeypatch):
    """The queued sleep hides the host's launch time; an op that synchronises inside the call (as a CUDA eigh's
    error check does) is flagged -- and its rounds must not lengthen the next sleep: doubling it every round made
    the ComRoPE row of a 20-round GPU run wait for hours (found on an H200)."""
    from ropekit.bench.measure import gpu_times

    gpu = _FakeGpu()
    _patch_fake_gpu(monkeypatch, gpu)

    def op():  # 0.1 ms of GPU work behind 0.3 ms of host launch overhead
        gpu.launch(0.05, host_ms=0.15)
        gpu.launch(0.05, host_ms=0.15)

    def syncing_op():
        gpu.launch(0.05, host_ms=0.15)
        gpu.sync()
        gpu.launch(0.05, host_ms=0.15)

    times, synced = gpu_times({"op": op}, repeats=40, device=torch.device("cuda", 0))
    assert not synced and len(times["op"]) == 40
    assert max(times["op"]) == pytest.approx(0.1)  # the GPU work alone, not the 0.3 ms of host time

    start = gpu.host
    times, synced = gpu_times({"op": op, "syncing": syncing_op}, repeats=40, device=torch.device("cuda", 0))
    assert synced
    assert gpu.host - start < 200.0  # 40 rounds of bounded sleeps (the unbounded rule took 2**40 ms)
    assert min(times["syncing"]) > 0.1  # host gaps inside the call: not the op's GPU time


def test_gpu_time_of_a_synchronising_op_is_reported_as_not_isolable():
    recs = _gpu_records()
    gpu_fields = dict(fwd_gpu_ms=2.0, fwdbwd_gpu_ms=4.9, floor_fwdbwd_gpu_ms=0.11, sdpa_fwdbwd_gpu_ms=0.2,
                      none_fwdbwd_gpu_ms=0.18, x_floor_gpu=44.5, frac_sdpa_gpu=24.5)
    for r in recs:
        if r["kind"] == "pe":
            r.update(gpu_fields, x_floor_gpu=r["fwdbwd_ms"] / 0.2)
    synced = dict(recs[0], label="comrope-ld (b=8)", pe="comrope-ld", fwdbwd_ms=4.6, x_floor=23.0, **gpu_fields,
                  gpu_synced=True)
    recs.append(synced)
    targets = {(t["target"], t["case"]): t for t in evaluate_targets(recs)}
    gpu = targets[("comrope-ld (b=8) fwd+bwd <= 2x floor (q*c, k*c), GPU time", "grid2d")]
    assert gpu["met"] is None and gpu["value"] is None and "synchronises the host" in gpu["note"]
    assert targets[("comrope-ld (b=8) fwd+bwd <= 2x floor (q*c, k*c)", "grid2d")]["met"] is False  # latency stands
    assert targets[("axial fwd+bwd <= 1.5x floor (q*c, k*c), GPU time", "grid2d")]["met"]
    report = format_report(recs, command="ropekit bench --device cuda --dtype bf16")
    assert "| comrope-ld (b=8) (synchronises the host: host gaps included) |" in report
    assert "| not isolable: the op synchronises the host |" in report
