"""Scale augmentation (``augment_sizes``): one token grid per step, drawn from the list, checked end to end."""

import pytest
import torch
import torch.nn.functional as F

from ropekit.classification import TrainConfig
from ropekit.train.augment import random_resize


def test_random_resize_draws_each_size_and_matches_interpolate():
    x = torch.rand(3, 1, 28, 28)
    torch.manual_seed(0)
    seen = {tuple(random_resize(x, [20, 28, 36]).shape) for _ in range(40)}
    assert seen == {(3, 1, 20, 20), (3, 1, 28, 28), (3, 1, 36, 36)}
    torch.manual_seed(0)
    y = random_resize(x, [20])
    ref = F.interpolate(x.double(), size=(20, 20), mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(y.double(), ref, atol=1e-6, rtol=0)
    assert random_resize(x, []) is x
    with pytest.raises(ValueError, match="images"):
        random_resize(torch.rand(2, 1, 4, 28, 28), [20])


def test_augment_sizes_validation():
    with pytest.raises(ValueError, match="augment_sizes"):
        TrainConfig.from_dict(dict(augment_sizes=[0])).validate()
    with pytest.raises(ValueError, match="multiple of the patch size"):
        TrainConfig.from_dict(dict(augment_sizes=[22], patch_size=4)).validate()
    assert TrainConfig.from_dict(dict(augment_sizes=[20, 24], patch_size=4)).validate().data.augment_sizes == [20, 24]


def test_training_with_scale_augmentation_sees_several_grids(tmp_path, monkeypatch):
    """A short run with normalised coordinates: the model's forward is called on 5x5, 7x7 and 9x9 grids."""
    from ropekit.nn import VisionTransformer
    from ropekit.classification import train

    grids = set()
    orig = VisionTransformer.forward

    def spy(self, x, *a, **k):
        if self.training:
            grids.add(tuple(x.shape[-2:]))
        return orig(self, x, *a, **k)

    monkeypatch.setattr(VisionTransformer, "forward", spy)
    cfg = TrainConfig.from_dict(dict(data="digits", pe="mixed", coords="normalized", patch_size=2, image_size=8,
                                     epochs=1,
                      batch_size=16, train_fraction=0.3, augment_sizes=[6, 8, 10], augment_shift=0,
                      model_options=dict(embed_dim=16, depth=1, num_heads=2), out=str(tmp_path / "run"),
                      progress=False, tensorboard=False, threads=1))
    res = train(cfg, quiet=True)
    assert grids == {(6, 6), (8, 8), (10, 10)}
    assert len(res.history) == 1 and 0.0 <= res.history[-1]["test_acc"] <= 1.0
