"""The engine with streamed epochs: mid-epoch checkpoints, exact resume from them, no per-step host reads, the
loss guard read once per log interval."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ropekit.train import load_checkpoint
from ropekit.train.engine import (EngineOptions, FitOptions, NonFiniteLossError, Schedule, StreamedEpoch, fit)

CPU = EngineOptions(device="cpu", progress=False, tensorboard=False, plots=False)
N, DIM, BS = 40, 6, 4  # 10 steps an epoch


pytestmark = pytest.mark.usefixtures("one_thread")


class StreamTask:
    """Regression with dropout and input noise (global RNG) whose epochs are streamed: ``open(step)`` yields the
    epoch's batches from ``step`` on, as a data loader with ``start_batch`` does; ``opened`` records the starts."""

    name = "stream"

    def __init__(self, nan_at: int = -1) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(DIM, 16), nn.Dropout(0.2), nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(N, DIM, generator=g)
        self.y = self.x.sum(-1, keepdim=True)
        self.opened, self.calls, self.nan_at = [], 0, nan_at

    def epoch_batches(self, epoch, ctx):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(100 + epoch))

        def open_(start):
            self.opened.append((epoch, start))
            for s in range(start, N // BS):
                idx = order[s * BS:(s + 1) * BS]
                yield self.x[idx], self.y[idx]

        return StreamedEpoch(N // BS, open_)

    def loss(self, model, batch, device):
        x, y = batch
        x = x + 0.01 * torch.randn_like(x)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        self.calls += 1
        if self.calls == self.nan_at:
            loss = loss * float("nan")
        return loss, {"loss_sum": loss.detach() * len(x), "count": len(x)}

    def epoch_row(self, epoch, sums, info, ctx):
        return {"epoch": epoch + 1, "loss": sums["loss_sum"] / sums["count"], "count": sums["count"]}


def _opts(run=None, epochs=2, **kw):
    return FitOptions(Schedule(lr=1e-2, total_steps=epochs * N // BS, warmup_steps=2), epochs, execution=CPU,
                      run_dir=run, quiet=True, **kw)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_streamed_epoch_stopped_mid_epoch_resumes_at_that_batch_bit_exactly(tmp_path):
    full = StreamTask()
    ref = fit(full, _opts())
    assert [r["count"] for r in ref.history] == [N, N]

    part = StreamTask()
    stopped = fit(part, _opts(tmp_path, on_step=lambda s: s == 13))
    assert stopped.interrupted and stopped.global_step == 13
    ckpt = load_checkpoint(tmp_path)
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 3)
    part, = ckpt["partial"]  # (one entry per rank)
    assert set(part) == {"loss_sum", "count", "time"} and part["count"] == 3 * BS

    torch.manual_seed(99)  # (a new process: the checkpoint restores the RNG)
    again = StreamTask()
    res = fit(again, _opts(tmp_path, resume=True))
    assert again.opened == [(1, 3)]  # the loader restarted at the batch after the checkpoint
    assert _same(full.model, again.model)
    assert [r["loss"] for r in res.history] == [r["loss"] for r in ref.history]  # the partial sums carried over


def test_checkpoint_every_saves_mid_epoch_and_a_crashed_run_continues_from_it(tmp_path):
    full = StreamTask()
    fit(full, _opts())

    class Crash(RuntimeError):
        pass

    crashing = StreamTask()
    real = crashing.loss

    def loss(model, batch, device):
        if crashing.calls == 16:  # the 17th step dies (a killed process)
            raise Crash
        return real(model, batch, device)

    crashing.loss = loss
    with pytest.raises(Crash):
        fit(crashing, _opts(tmp_path, checkpoint_every=4))
    ckpt = load_checkpoint(tmp_path)
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["global_step"]) == (1, 6, 16)

    again = StreamTask()
    fit(again, _opts(tmp_path, resume=True, checkpoint_every=4))
    assert again.opened == [(1, 6)]
    assert _same(full.model, again.model)
    # no mid-epoch checkpoint at an epoch's last step: the epoch's own checkpoint is the one
    assert load_checkpoint(tmp_path)["step_in_epoch"] == 0


def test_a_nan_loss_raises_before_the_next_checkpoint_and_keeps_the_previous_one(tmp_path):
    """log_every 100 > the run: the guard is read only before each checkpoint (every 4 steps) and names the step."""
    task = StreamTask(nan_at=6)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at step 6 \(epoch 1, batch 6\), found "
                                                 r"after step 8 .*nothing trained since was saved; the last good "
                                                 r"checkpoint .* is intact"):
        fit(task, _opts(tmp_path, checkpoint_every=4, log_every=100))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not all(torch.isfinite(p).all() for p in task.model.parameters())  # (the update did happen in memory)

    # log_every 1: checked before every update, as a step-by-step loop does
    task = StreamTask(nan_at=6)
    with pytest.raises(NonFiniteLossError, match=r"at step 6 \(epoch 1, batch 6\): stopped before the update"):
        fit(task, _opts(tmp_path / "each", log_every=1))
    assert all(torch.isfinite(p).all() for p in task.model.parameters())


class _HostReads(TorchFunctionMode):
    """Records every read of a tensor's value on the host (``item``, ``float()``, ``tolist``...), per training step
    (``step`` is advanced by ``on_step``); the optimiser's step counters are left out (they live on the host even
    when the model is on a GPU)."""

    READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"}

    def __init__(self, ignore) -> None:
        super().__init__()
        self.ignore, self.step, self.reads = ignore, 0, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS and args and not any(args[0] is t for t in self.ignore()):
            self.reads.setdefault(self.step + 1, []).append(name)
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_nothing_back_from_the_device():
    task = StreamTask()
    opt = torch.optim.AdamW(task.model.parameters(), lr=1e-2)
    mode = _HostReads(lambda: [s["step"] for s in opt.state.values()])

    def on_step(step):
        mode.step = step

    with mode:
        res = fit(task, _opts(epochs=2, log_every=4, on_step=on_step, optimizer=opt))
    assert res.global_step == 20
    # reads (counted towards the next step after each ``on_step``) happen in the set-up (1), the steps that hold a
    # log check (4, 8, 12, 16, 20) and after an epoch's last step (11, 21: its check and metrics); never elsewhere
    assert set(mode.reads) <= {1, 4, 8, 11, 12, 16, 20, 21}, mode.reads
    assert {4, 8, 12, 16} <= set(mode.reads)  # (the detector sees reads)


def test_streamed_epoch_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="length must be an integer >= 0"):
        StreamedEpoch(-1, lambda s: [])
    for bad in ({"log_every": 0}, {"checkpoint_every": -1}, {"log_every": 2.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer"):
            fit(StreamTask(), _opts(**bad))

    class Short(StreamTask):
        def epoch_batches(self, epoch, ctx):
            inner = super().epoch_batches(epoch, ctx)
            return StreamedEpoch(len(inner) + 2, inner.iter_from)

    with pytest.raises(RuntimeError, match=r"the data of epoch 1 ended after 10 of its 12 batches"):
        fit(Short(), _opts())


@pytest.mark.slow
def test_a_classification_step_reads_nothing_back_either(tmp_path, monkeypatch):
    """The ViT classification task on in-memory digits, coordinate checks deferred (as on an accelerator) and no
    random shift (its offsets are drawn on the host by design): no step reads the device outside the log checks."""
    import ropekit.encodings
    from ropekit.train import engine
    from ropekit.classification import train

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import tiny_cfg

    made = []
    real = engine.build_optimizer
    monkeypatch.setattr(engine, "build_optimizer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    mode = _HostReads(lambda: [s["step"] for opt in made for s in opt.state.values()])
    previous = ropekit.encodings.set_coord_validation("deferred")
    try:
        with mode:
            res = train(tiny_cfg(tmp_path / "r", epochs=1, augment_shift=0, log_every=2),
                        on_step=lambda s: setattr(mode, "step", s), quiet=True)
    finally:
        ropekit.encodings.set_coord_validation(previous)
    assert res.history[0]["epoch"] == 1  # (5 steps)
    assert set(mode.reads) <= {1, 2, 4, 6}, mode.reads  # set-up, the checks of steps 2 and 4, the epoch's end
