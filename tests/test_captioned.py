"""Captioned RGB-D scenes, the word tokenizer and the text tower."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropekit.data import load_dataset
from ropekit.data.builtin import load_mnist5k
from ropekit.data.captioned import (CLASS_NAMES, COLOUR_NAMES, SIZE_WORDS, VOCABULARY, SceneConfig,
                                    make_captioned_scenes, shape_glyphs)
from ropekit.data.text import Tokenizer, split_words
from ropekit.nn import TextConfig, TextTransformer


@pytest.fixture(scope="module")
def scenes():
    images, labels = load_mnist5k()
    return make_captioned_scenes(images, labels, 400, SceneConfig(), seed=3)


def test_shapes_and_ranges(scenes):
    n, m = len(scenes), 3
    assert scenes.images.shape == (n, 4, 32, 32) and scenes.images.dtype == torch.float32
    rgb, depth = scenes.images[:, :3], scenes.images[:, 3]
    assert rgb.min() >= 0 and rgb.max() <= 1
    assert torch.isfinite(depth).all() and depth.min() == 0  # holes are 0
    valid_depth = depth[depth > 0]
    assert 0.02 < (depth == 0).float().mean() < 0.15
    assert valid_depth.min() > 1.5 and valid_depth.max() < 8
    assert scenes.classes.shape == (n, m) and scenes.box3d.shape == (n, m, 12)
    k = scenes.valid.sum(1)
    assert k.min() >= 1 and k.max() <= 3
    assert ((scenes.classes >= 0) == scenes.valid).all() and ((scenes.colours >= 0) == scenes.valid).all()
    # padding slots are zero / -1
    assert (scenes.box2d[~scenes.valid] == 0).all() and (scenes.visible[~scenes.valid] == 0).all()


def test_deterministic_and_seed_dependent():
    images, labels = load_mnist5k()
    a = make_captioned_scenes(images, labels, 20, seed=1)
    b = make_captioned_scenes(images, labels, 20, seed=1)
    c = make_captioned_scenes(images, labels, 20, seed=2)
    assert torch.equal(a.images, b.images) and a.captions == b.captions
    assert not torch.equal(a.images, c.images)


def test_geometry_is_a_pinhole_projection(scenes):
    """The 3-D box centre projects through K to the 2-D box centre; its extent projects to the box's size."""
    K = scenes.K.double()
    v = scenes.valid
    c = scenes.box3d[..., :3].double()[v]  # (n, 3)
    uvw = c @ K.T
    uv = uvw[:, :2] / uvw[:, 2:]
    b = scenes.box2d.double()[v]
    assert torch.allclose(uv, (b[:, :2] + b[:, 2:]) / 2, atol=1e-3)
    f = K[0, 0]
    ext = scenes.box3d[..., 9:11].double()[v]
    assert torch.allclose(ext * f / c[:, 2:], b[:, 2:] - b[:, :2], atol=1e-3)
    # rotation columns: identity (cards face the camera); depth of the box = the object's depth
    assert torch.equal(scenes.box3d[..., 3:9][v], torch.tensor([1.0, 0, 0, 0, 1, 0]).expand(int(v.sum()), 6))
    assert torch.allclose(c[:, 2].float(), scenes.depth[v])
    # clipped boxes lie in the image and inside the full box
    cl = scenes.box2d_clipped[v]
    assert cl[:, [0, 2]].min() >= 0 and cl[:, [0, 2]].max() <= 32 and cl[:, [1, 3]].max() <= 32
    assert (cl[:, :2] >= b[:, :2].float() - 1e-5).all() and (cl[:, 2:] <= b[:, 2:].float() + 1e-5).all()
    assert (b[:, 0] < 0).any() or (b[:, 2] > 32).any()  # some objects cross the border (and are clipped)


def test_solid_objects_are_blocks_whose_front_face_is_the_card():
    """``solid``: same images and 2-D boxes; the 3-D box is as deep as the object's true size, its front face at
    the object's depth (what the depth map shows) projects exactly onto the 2-D box, the whole box projects over it."""
    from ropekit.detection.boxes import box12_to_corners

    images, labels = load_mnist5k()
    card = make_captioned_scenes(images, labels, 40, SceneConfig(), seed=5)
    block = make_captioned_scenes(images, labels, 40, SceneConfig(solid=True), seed=5)
    assert torch.equal(card.images, block.images) and card.captions == block.captions
    assert torch.equal(card.box2d, block.box2d) and torch.equal(card.depth, block.depth)
    v = block.valid
    b3 = block.box3d.double()[v]  # (n, 12)
    size = b3[:, 9:]
    assert torch.allclose(size[:, 2], block.true_size.double()[v], atol=1e-6) and (size[:, 2] >= 0.4).all()
    assert torch.allclose(block.box3d[..., :2], card.box3d[..., :2]) and torch.equal(block.box3d[..., 3:11],
                                                                                     card.box3d[..., 3:11])
    assert torch.allclose(b3[:, 2] - size[:, 2] / 2, block.depth.double()[v], atol=1e-5)  # front face = depth
    assert torch.allclose(card.box3d[..., 11][v], torch.full((int(v.sum()),), 0.02))  # cards stay 2 cm
    corners = box12_to_corners(b3)  # (n, 8, 3)
    K = block.K.double()
    uvw = corners @ K.T
    uv = uvw[..., :2] / uvw[..., 2:]
    b2 = block.box2d.double()[v]
    front = (corners[..., 2] - corners[..., 2].min(1, keepdim=True).values).abs() < 1e-6  # (n, 8): 4 per box
    assert (front.sum(1) == 4).all()
    fu = uv[front].view(-1, 4, 2)
    assert torch.allclose(torch.cat([fu.min(1).values, fu.max(1).values], 1), b2, atol=1e-3)
    assert (uv.min(1).values <= b2[:, :2] + 1e-3).all() and (uv.max(1).values >= b2[:, 2:] - 1e-3).all()
    # the depth map at a fully visible object's centre holds the front face (box centre z - half thickness)
    hits = 0
    for i in range(40):
        for j in torch.nonzero(v[i]).flatten().tolist():
            if block.visible[i, j] < 0.99:
                continue
            x0, y0, x1, y1 = block.box2d[i, j].tolist()
            cy, cx = int((y0 + y1) / 2), int((x0 + x1) / 2)
            patch = block.images[i, 3, max(cy - 1, 0):cy + 2, max(cx - 1, 0):cx + 2].flatten()
            patch = patch[patch > 0]
            front_z = float(block.box3d[i, j, 2] - block.box3d[i, j, 11] / 2)
            hits += int(len(patch) > 0 and float((patch - front_z).abs().min()) < 0.05 * front_z)
            assert len(patch) == 0 or float((patch - block.box3d[i, j, 2]).abs().min()) > 0.05  # not the centre
    assert hits > 10


def test_depth_map_matches_objects(scenes):
    """Where an object is fully visible and the depth is valid, the depth map holds the object's depth (+- noise)."""
    hits = 0
    for i in range(60):
        for o in scenes.objects(i):
            if o["visible"] < 0.99:
                continue
            x0, y0, x1, y1 = o["box2d"]
            cy, cx = int((y0 + y1) / 2), int((x0 + x1) / 2)
            patch = scenes.images[i, 3, max(cy - 1, 0):cy + 2, max(cx - 1, 0):cx + 2].flatten()
            near = patch[(patch > 0) & ((patch - o["depth"]).abs() < 0.05 * o["depth"])]
            hits += int(len(near) > 0)
    assert hits > 20


def test_apparent_size_does_not_give_depth_order(scenes):
    """In a sizeable fraction of object pairs the apparently larger object is the farther one."""
    disagree = total = 0
    area = (scenes.box2d[..., 2] - scenes.box2d[..., 0]) * (scenes.box2d[..., 3] - scenes.box2d[..., 1])
    for i in range(len(scenes)):
        idx = scenes.valid[i].nonzero().flatten().tolist()
        for a in idx:
            for b in idx:
                if a < b and abs(float(scenes.depth[i, a] - scenes.depth[i, b])) > 0.2:
                    total += 1
                    disagree += int(bool(area[i, a] > area[i, b]) != bool(scenes.depth[i, a] < scenes.depth[i, b]))
    assert total > 100
    assert 0.15 < disagree / total < 0.5
    # and the size word is the true size's
    v = scenes.valid
    small = scenes.true_size[v][scenes.sizes[v] == 0]
    big = scenes.true_size[v][scenes.sizes[v] == 1]
    assert small.max() < big.min()


def test_captions_follow_the_grammar_and_the_scene(scenes):
    vocab = set(VOCABULARY)
    n_depth = 0
    for i in range(len(scenes)):
        words = scenes.captions[i][0]
        assert set(words) <= vocab
        objs = {(o["colour"], o["name"]): o for o in scenes.objects(i)}
        text = " ".join(words)
        head, _, rel = text.partition(" . ")
        phrases = head.split(" and ")
        assert len(phrases) == len(objs)
        for p in phrases:
            a, size, colour, name = p.split()
            assert a == "a" and objs[(colour, name)]["size"] == size
        if rel:
            w = rel.split()
            first, second = objs[(w[1], w[2])], objs[(w[-2], w[-1])]
            phrase = " ".join(w[4:-3])
            if phrase == "in front of":
                n_depth += 1
                assert first["depth"] < second["depth"] - 0.39
            elif phrase == "behind":
                n_depth += 1
                assert first["depth"] > second["depth"] + 0.39
            else:
                cx = lambda o: (o["box2d"][0] + o["box2d"][2]) / 2  # noqa: E731
                cy = lambda o: (o["box2d"][1] + o["box2d"][3]) / 2  # noqa: E731
                gap = {"left of": cx(second) - cx(first), "right of": cx(first) - cx(second),
                       "above": cy(second) - cy(first), "below": cy(first) - cy(second)}[phrase]
                assert gap >= 2.0 - 1e-4
    assert n_depth > 50


def test_occlusion_reduces_visibility(scenes):
    """A nearer object that overlaps a farther one lowers the farther one's visible fraction, never the other way."""
    v = scenes.visible[scenes.valid]
    assert (v >= 0).all() and (v <= 1).all() and (v < 0.9).any() and (v > 0.99).any()
    # single-object scenes fully inside the image are (nearly) fully visible
    one = scenes.valid.sum(1) == 1
    b = scenes.box2d[:, 0]
    inside = one & (b[:, 0] >= 0) & (b[:, 1] >= 0) & (b[:, 2] <= 32) & (b[:, 3] <= 32)
    assert inside.sum() > 10 and scenes.visible[inside, 0].min() > 0.6


def test_bad_input():
    images, labels = load_mnist5k()
    with pytest.raises(ValueError, match="min_objects must be >= 1"):
        make_captioned_scenes(images, labels, 2, SceneConfig(min_objects=0))
    with pytest.raises(ValueError, match="every digit"):
        make_captioned_scenes(images[labels < 5], labels[labels < 5], 2)
    with pytest.raises(ValueError, match="wall_depth"):
        SceneConfig(wall_depth=(3.0, 4.0)).validate()
    empty = make_captioned_scenes(images, labels, 0)
    assert empty.images.shape == (0, 4, 32, 32) and empty.captions == []


def test_shape_glyphs():
    g = shape_glyphs()
    assert g.shape == (4, 28, 28) and g.min() >= 0 and g.max() <= 1
    area = (g > 0.5).float().sum((1, 2))
    # square > circle > diamond, triangle: areas of the drawn shapes in the central 20x20
    assert area[0] > area[1] > area[3] and area[2] > 80


def test_dataset_registration():
    train, test, info = load_dataset("captioned-scenes", num_train=30, num_test=20, image_size=24, normalize=True)
    assert info.kind == "rgbd" and info.num_classes == len(CLASS_NAMES) and info.image_size == (24, 24)
    assert train.images.shape == (30, 4, 24, 24) and len(test) == 20
    assert train.scenes.images is train.images  # normalised together
    # the label is the class of the nearest object
    d = torch.where(test.scenes.valid, test.scenes.depth, torch.tensor(float("inf")))
    assert torch.equal(test.labels, test.scenes.classes[torch.arange(20), d.argmin(1)])


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_padding():
    tok = Tokenizer(context_length=20)
    ids = tok(["A big red 3.", "the blue square is behind the red 3"])
    assert ids.shape == (2, 20) and ids.dtype == torch.int64
    assert tok.decode(ids[0]) == "a big red 3 ."
    assert tok.decode(ids[1]) == "the blue square is behind the red 3"
    assert (ids[0, 5:] == 0).all() and (ids[0, :5] > 1).all()
    assert tok.vocab_size == len(VOCABULARY) + 2
    assert split_words("The red 3, the cyan 5.") == ["the", "red", "3", ",", "the", "cyan", "5", "."]
    for w in SIZE_WORDS + COLOUR_NAMES + CLASS_NAMES:
        assert tok.encode(w)[0] > 1


def test_tokenizer_errors():
    tok = Tokenizer(context_length=6)
    with pytest.raises(ValueError, match="empty text"):
        tok(["   "])
    with pytest.raises(ValueError, match="unknown word.*'dog'"):
        tok(["a big dog"])
    assert Tokenizer(unknown="unk").encode("a big dog") == [tok.index["a"], tok.index["big"], 1]
    with pytest.raises(ValueError, match="longer than the context of 6"):
        tok(["a big red 3 and a small blue 4"])
    assert len(Tokenizer(context_length=6, truncate=True).encode("a big red 3 and a small blue 4")) == 6
    with pytest.raises(ValueError, match="unknown must be"):
        Tokenizer(unknown="skip")


# --------------------------------------------------------------------------- text tower


def test_text_tower_pooling_is_batch_independent_and_position_aware():
    torch.manual_seed(0)
    tok = Tokenizer(context_length=16)
    tower = TextTransformer(TextConfig(tok.vocab_size, context_length=16, embed_dim=32, depth=2, num_heads=2))
    a = tok(["a big red 3 . the red 3 is left of the blue 4"])
    b = tok(["a big red 3 . the blue 4 is left of the red 3"])  # same words, other order
    ea, eb = tower(a), tower(b)
    assert ea.shape == (1, 32)
    assert not torch.allclose(ea, eb, atol=1e-4)  # positions matter (RoPE)
    both = tower(torch.cat([a, b]))
    assert torch.allclose(both, torch.cat([ea, eb]), atol=1e-5)
    # fewer columns are padded to the context: the same embedding
    assert (a[:, 14:] == 0).all() and torch.allclose(tower(a[:, :14]), ea, atol=1e-5)
    # without positions the two word orders give the same bag of words
    bag = TextTransformer(TextConfig(tok.vocab_size, context_length=16, embed_dim=32, pe="none"))
    assert torch.allclose(bag(a), bag(b), atol=1e-5)
    # gradients reach every parameter
    tower(torch.cat([a, b])).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in tower.parameters())


def test_text_tower_errors():
    tower = TextTransformer(TextConfig(10, context_length=4, embed_dim=16, num_heads=2))
    with pytest.raises(ValueError, match="longer than the tower's context"):
        tower(torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="must lie in"):
        tower(torch.full((1, 3), 10))
    with pytest.raises(ValueError, match="padding only"):
        tower(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown pe"):
        TextConfig(10, pe="bogus").validate()
    with pytest.raises(ValueError, match="even"):
        TextConfig(10, embed_dim=6, num_heads=2).validate()


@pytest.mark.parametrize("pe", ["cayley", "absolute"])
def test_text_tower_other_encodings(pe):
    tower = TextTransformer(TextConfig(12, context_length=8, embed_dim=16, num_heads=2, pe=pe))
    out = tower(torch.randint(1, 12, (3, 8)))
    assert out.shape == (3, 16) and torch.isfinite(out).all()
    assert (pe == "absolute") == ("pos_table" in tower.no_weight_decay())


def _depth_pairs(s, gap):
    """(nearer looks bigger, nearer sits lower, boxes meet) per object pair that a depth relation can state."""
    out = []
    side = s.true_size / torch.where(s.valid, s.depth, torch.ones_like(s.depth))  # apparent side / f
    cy = (s.box2d[..., 1] + s.box2d[..., 3]) / 2
    b = s.box2d
    for i in range(len(s)):
        idx = s.valid[i].nonzero().flatten().tolist()
        for a in idx:
            for c in idx:
                if a < c and abs(float(s.depth[i, a] - s.depth[i, c])) >= gap:
                    near, far = (a, c) if s.depth[i, a] < s.depth[i, c] else (c, a)
                    meet = bool(min(b[i, a, 2], b[i, c, 2]) > max(b[i, a, 0], b[i, c, 0])
                                and min(b[i, a, 3], b[i, c, 3]) > max(b[i, a, 1], b[i, c, 1]))
                    out.append((bool(side[i, near] > side[i, far]), bool(cy[i, near] > cy[i, far]), meet))
    return np.array(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_depth_only_scenes_carry_no_2d_depth_cue(seed):
    """``cues="depth-only"``: over the pairs a depth relation can state (depth gap >= min_depth_gap), the nearer
    object looks bigger, and sits lower, in half of them (binomial: within 4 standard errors of 0.5, with margin
    for pairs of one scene being dependent); no two objects' boxes meet; image height is uncorrelated with depth
    (|r| < 4/sqrt(n)). The natural scenes, drawn from the same seed, show the cues the variant removes."""
    images, labels = load_mnist5k()
    cfg = SceneConfig(cues="depth-only")
    s = make_captioned_scenes(images, labels, 1200, cfg, seed=[seed, 9])
    pairs = _depth_pairs(s, cfg.min_depth_gap)
    n = len(pairs)
    assert n > 800
    tol = 4 * 0.5 / np.sqrt(n)
    assert abs(pairs[:, 0].mean() - 0.5) < tol, pairs[:, 0].mean()
    assert abs(pairs[:, 1].mean() - 0.5) < tol, pairs[:, 1].mean()
    assert pairs[:, 2].sum() == 0  # occlusion: never (the centres are redrawn until no boxes meet)
    v = s.valid
    cy = ((s.box2d[..., 1] + s.box2d[..., 3]) / 2)[v].double()
    r = float(torch.corrcoef(torch.stack([cy, s.depth[v].double()]))[0, 1])
    assert abs(r) < 4 / np.sqrt(int(v.sum())), r
    # the apparent side of a size class does not depend on depth: f * size / d_mid for every object
    f = float(s.K[0, 0])
    d_mid = sum(cfg.depth_range) / 2
    px = (f * s.true_size / torch.where(v, s.depth, torch.ones_like(s.depth)))[v]
    small, big = px[s.sizes[v] == 0], px[s.sizes[v] == 1]
    for got, (lo, hi) in ((small, cfg.small_size), (big, cfg.big_size)):  # float32 rounding: 1e-3 px
        assert torch.all(got >= f * lo / d_mid - 1e-3) and torch.all(got <= f * hi / d_mid + 1e-3)
    # every card above the floor: nothing is hidden except by the image border
    inside = (s.box2d[..., 0] >= 0) & (s.box2d[..., 1] >= 0) & (s.box2d[..., 2] <= 32) & (s.box2d[..., 3] <= 32)
    assert torch.all(s.visible[v & inside] > 0.97)
    # the natural scenes: the nearer object looks bigger in about 70-75 % of the pairs
    nat = _depth_pairs(make_captioned_scenes(images, labels, 1200, SceneConfig(), seed=[seed, 9]), 0.4)
    assert nat[:, 0].mean() > 0.65 and nat[:, 2].mean() > 0.05


def test_depth_only_is_an_option_of_the_dataset():
    train, test, _ = load_dataset("captioned-scenes", num_train=40, num_test=40, image_size=16, cues="depth-only")
    s = test.scenes
    pairs = _depth_pairs(s, 0.4)
    assert len(pairs) and pairs[:, 2].sum() == 0  # no two objects meet
    with pytest.raises(ValueError, match="cues must be one of natural, depth-only"):
        SceneConfig(cues="flat").validate()
