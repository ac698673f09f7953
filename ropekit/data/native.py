"""Native-resolution data: every image keeps its aspect ratio, gets a sampled number of tokens, and images are packed
into rows of a fixed token budget (NaViT's "patch n' pack"), decoded and packed in DataLoader workers.

How an epoch is made (a pure function of ``(seed, epoch, rank, world_size)``, so that a run resumed mid-epoch sees
exactly the batches it would have seen):

1. the plan (:func:`plan_epoch`, in the main process, no file opened): this rank's images in a seeded order
   (``perm[rank::world_size]`` of a permutation of the data set), each with a token budget ``t`` drawn uniformly
   from ``[min_tokens, max_tokens]`` (NaViT's resolution sampling); images go into rows of ``seq_len`` tokens in
   that order (a row is closed when the next image does not fit), ``rows`` rows per batch. A training epoch has a
   fixed number of batches (:meth:`NativeLoader.steps`, from the expected tokens per image): the order wraps
   around where an epoch's draws need more images, so every epoch and every rank has the same length;
2. a batch (:class:`NativeBatches`, in a worker): each image is read, resized to the grid of at most ``t``
   patches with its aspect ratio (:func:`grid_for`; colour bilinear with antialiasing, depth nearest -- never
   interpolated across a depth edge), flipped with probability ``hflip``, cut into patches (``token_drop``: that
   fraction of its tokens dropped at random), and the images are packed as planned
   (:func:`ropekit.nn.packing.pack`). Random draws per image come from ``(seed, epoch, image index)``.

Sources: any map-style data set whose items are ``(image, label)``: uint8 ``(3, H, W)`` RGB from
:class:`ropekit.data.streaming.ImageFolderStream` (converted to float and standardised with ``mean``/``std``), or
float ``(C, H, W)`` / ``(C + 1, H, W)`` RGB-D (depth last, ``depth=True``) as ``ropekit.data.load_dataset`` gives
them, or the pair ``(uint8 (3, H, W) RGB, float (1, H, W) depth)`` of RGB-D shards
(:class:`ropekit.data.shard_source.ShardSource`, which also reads RGB shards by index). An unreadable file fails
with its own one-line :class:`~ropekit.data.DataFileError`, from a worker too. Memory stays bounded: only the images
of the batches in flight are decoded.

Shape legend: ``B`` rows per batch, ``N`` tokens per row (``seq_len``), ``t`` an image's token budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..nn.packing import PackedBatch, pack, patchify
from ._common import DataFileError
from .worker import WorkerFailure, failed_in_worker

__all__ = ["NativeOptions", "grid_for", "plan_epoch", "NativeBatches", "NativeLoader", "resize_to_grid",
           "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Plan = List[List[List[Tuple[int, int]]]]  # batches -> rows -> (image index, token budget)


@dataclass(frozen=True)
class NativeOptions:
    """Options of the native-resolution loader.

    Attributes:
        patch_size: ``p``.
        seq_len: tokens per packed row (``N``).
        rows: rows per batch (``B``).
        min_tokens, max_tokens: the range of an image's token budget in training (``max_tokens=None``: ``seq_len``).
        eval_tokens: the token budget of every image in evaluation (``None``: ``max_tokens``).
        max_images: at most this many images per row (``None``: no limit).
        token_drop: fraction of each training image's tokens dropped at random (NaViT), ``[0, 1)``.
        hflip: horizontal flip probability in training.
        aspect: aspect-ratio stretch in training (``>= 1``; 1: none): each image's height-to-width ratio is multiplied
            by a log-uniform factor in ``[1 / aspect, aspect]`` before its grid is chosen (the image is resized to that
            grid, so it is stretched), which gives data of one shape (MNIST's squares) mixed aspect ratios.
        depth: the last channel is metric depth (RGB-D): resized with nearest, never standardised.
        mean, std: per-colour-channel standardisation of uint8 sources (ImageNet's by default).
    """

    patch_size: int
    seq_len: int = 256
    rows: int = 8
    min_tokens: int = 16
    max_tokens: Optional[int] = None
    eval_tokens: Optional[int] = None
    max_images: Optional[int] = None
    token_drop: float = 0.0
    hflip: float = 0.5
    aspect: float = 1.0
    depth: bool = False
    mean: Tuple[float, ...] = IMAGENET_MEAN
    std: Tuple[float, ...] = IMAGENET_STD

    def __post_init__(self) -> None:
        hi = self.max_image_tokens
        for name, v in (("patch_size", self.patch_size), ("seq_len", self.seq_len), ("rows", self.rows),
                        ("min_tokens", self.min_tokens), ("max_tokens", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"native resolution: {name} must be a positive integer, got {v!r}")
        if not self.min_tokens <= hi <= self.seq_len:
            raise ValueError(f"native resolution needs min_tokens <= max_tokens <= seq_len, got {self.min_tokens}, "
                             f"{hi}, {self.seq_len}")
        if self.eval_tokens is not None and not 1 <= self.eval_tokens <= self.seq_len:
            raise ValueError(f"native resolution: eval_tokens must be in [1, seq_len], got {self.eval_tokens}")
        if not (math.isfinite(self.aspect) and self.aspect >= 1.0):
            raise ValueError(f"native resolution: aspect must be a finite number >= 1, got {self.aspect}")
        if not 0.0 <= self.token_drop < 1.0 or not 0.0 <= self.hflip <= 1.0:
            raise ValueError(f"native resolution: token_drop must be in [0, 1) and hflip in [0, 1], got "
                             f"{self.token_drop}, {self.hflip}")

    @property
    def max_image_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.seq_len

    @property
    def eval_image_tokens(self) -> int:
        return self.eval_tokens if self.eval_tokens is not None else self.max_image_tokens


def grid_for(height: int, width: int, tokens: int, patch_size: int) -> Tuple[int, int]:
    """The patch grid ``(gh, gw)`` of an ``height x width`` image resized to at most ``tokens`` patches with its aspect
    ratio: ``gh = floor(H f / p)``, ``gw = floor(W f / p)`` with ``f = sqrt(tokens p^2 / (H W))`` (so
    ``gh gw <= tokens``), each at least 1 (a side that would round to 0 gets 1 and the other is cut to fit)."""
    if min(height, width, tokens, patch_size) < 1:
        raise ValueError(f"grid_for needs positive sizes, got {height}x{width}, {tokens} tokens, patch {patch_size}")
    f = math.sqrt(tokens * patch_size * patch_size / (height * width))
    gh = max(1, int(math.floor(height * f / patch_size + 1e-9)))
    gw = max(1, int(math.floor(width * f / patch_size + 1e-9)))
    if gh * gw > tokens:  # one side was raised to 1: cut the other
        if gh == 1:
            gw = max(1, tokens)
        else:
            gh = max(1, tokens // gw)
    return gh, gw


def _rows(items: Sequence[Tuple[int, int]], seq_len: int, max_images: Optional[int]) -> List[List[Tuple[int, int]]]:
    rows: List[List[Tuple[int, int]]] = []
    used = seq_len + 1
    for it in items:
        if used + it[1] > seq_len or (max_images is not None and len(rows[-1]) >= max_images):
            rows.append([])
            used = 0
        rows[-1].append(it)
        used += it[1]
    return rows


def plan_epoch(n: int, opts: NativeOptions, *, seed: int, epoch: int, rank: int = 0, world_size: int = 1,
               train: bool = True, steps: Optional[int] = None) -> Plan:
    """The batches of one epoch for one rank: rows of ``(image index, token budget)`` (see the module docstring).

    Args:
        n: images in the data set.
        opts: :class:`NativeOptions`.
        seed, epoch, rank, world_size: the plan is a pure function of these.
        train: shuffled order and sampled budgets; ``False``: every image once, in order, at ``eval_tokens``.
        steps: the number of batches (training; ``None``: as many as this epoch's images fill).
    """
    if n < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"plan_epoch needs n >= 1 and 0 <= rank < world_size, got {n}, {rank}, {world_size}")
    if not train:
        mine = np.arange(rank, n, world_size)
        rows = _rows([(int(i), opts.eval_image_tokens) for i in mine], opts.seq_len, opts.max_images)
        return [rows[i:i + opts.rows] for i in range(0, len(rows), opts.rows)]
    rng = np.random.default_rng([int(seed), int(epoch), 0x4E415456])
    lo, hi = opts.min_tokens, opts.max_image_tokens
    items: List[Tuple[int, int]] = []
    rows: List[List[Tuple[int, int]]] = []
    rounds = 0
    while True:
        perm = rng.permutation(n)
        budget = rng.integers(lo, hi + 1, size=n)
        mine = [(int(perm[j]), int(budget[j])) for j in range(rank, n, world_size)]
        items += mine
        rows = _rows(items, opts.seq_len, opts.max_images)
        rounds += 1
        if steps is None or len(rows) > steps * opts.rows or rounds > 1000:
            break
    if steps is not None:  # the last row may still grow with more images: only complete rows are kept
        rows = rows[:steps * opts.rows]
    elif rows and len(rows) % opts.rows:  # drop the incomplete last batch
        rows = rows[:len(rows) - len(rows) % opts.rows] or rows
    return [rows[i:i + opts.rows] for i in range(0, len(rows), opts.rows)]


def resize_to_grid(image: Tensor, grid: Tuple[int, int], patch_size: int, depth: bool = False) -> Tensor:
    """``image`` ``(C, H, W)`` float resized to ``(gh p, gw p)``: colour bilinear with antialiasing, the last channel
    with nearest (``"nearest-exact"``) when ``depth``, so no depth value is made up across an edge."""
    size = (grid[0] * patch_size, grid[1] * patch_size)
    if tuple(image.shape[-2:]) == size:
        return image
    colour = image[:-1] if depth else image
    out = F.interpolate(colour[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    if depth:
        d = F.interpolate(image[-1:][None], size=size, mode="nearest-exact")[0]
        out = torch.cat([out, d])
    return out


class NativeBatches(Dataset):
    """Map-style data set of the packed batches of one plan: ``ds[j]`` is batch ``j`` (:class:`PackedBatch`), built
    in the calling process (a DataLoader worker)."""

    def __init__(self, source: Dataset, opts: NativeOptions, plan: Plan, *, seed: int, epoch: int,
                 train: bool = True) -> None:
        self.source, self.opts, self.plan = source, opts, plan
        self.seed, self.epoch, self.train = int(seed), int(epoch), bool(train)

    def __len__(self) -> int:
        return len(self.plan)

    def _image(self, index: int, tokens: int) -> Any:
        from ..nn.packing import PatchedImage

        o = self.opts
        image, label = self.source[index]
        depth = None
        if isinstance(image, tuple):  # RGB-D shards: (uint8 RGB, float depth (1, H, W))
            if not o.depth:
                raise ValueError(f"native resolution: item {index} carries depth; set NativeOptions(depth=True)")
            image, depth = image
        x = torch.as_tensor(image)
        if x.dtype == torch.uint8:  # an 8-bit RGB file: [0, 1], then standardised
            x = x.float() / 255.0
            c = x.shape[0] - int(o.depth and depth is None)
            mean = torch.tensor(o.mean[:c]).view(-1, 1, 1)
            std = torch.tensor(o.std[:c]).view(-1, 1, 1)
            x = torch.cat([(x[:c] - mean) / std, x[c:]])
        x = x.float()
        if depth is not None:
            x = torch.cat([x, torch.as_tensor(depth, dtype=torch.float32)])
        if x.dim() != 3:
            raise ValueError(f"native resolution takes (C, H, W) images, got {tuple(x.shape)} for item {index}")
        rng = np.random.default_rng([self.seed, self.epoch, int(index), 0x50415443])
        h, w = float(x.shape[-2]), float(x.shape[-1])
        if self.train and o.aspect > 1.0:  # its own stream: the flip and drop draws stay as without a stretch
            u = np.random.default_rng([self.seed, self.epoch, int(index), 0x41535043]).random()
            r = math.exp((2.0 * u - 1.0) * math.log(o.aspect))  # height-to-width ratio multiplied by r
            h, w = h * math.sqrt(r), w / math.sqrt(r)
        grid = grid_for(max(1, round(h)), max(1, round(w)), tokens, o.patch_size)
        x = resize_to_grid(x, grid, o.patch_size, o.depth)
        if self.train and o.hflip > 0 and rng.random() < o.hflip:
            x = x.flip(-1)
        drop = o.token_drop if self.train else 0.0
        gen = torch.Generator().manual_seed(int(rng.integers(2 ** 62))) if drop > 0 else None
        out: PatchedImage = patchify(x, o.patch_size, depth=o.depth, label=int(label), drop=drop, generator=gen)
        return out

    def __getitem__(self, j: int) -> PackedBatch:
        images, rows = [], []
        try:
            for row in self.plan[j]:
                ids = []
                for index, tokens in row:
                    ids.append(len(images))
                    images.append(self._image(index, tokens))
                rows.append(ids)
        except DataFileError as e:  # in a worker: a value, raised as it is by NativeLoader (one line)
            return failed_in_worker(e)  # type: ignore[return-value]
        return pack(images, self.opts.seq_len, max_images=self.opts.max_images, rows=rows)


def _first(batch: Any) -> Any:
    return batch


class _Batches:
    """The DataLoader of one epoch's batches, raising a worker's :class:`DataFileError` as it is."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[PackedBatch]:
        for batch in self.loader:
            if isinstance(batch, WorkerFailure):
                raise batch.error
            yield batch


class NativeLoader:
    """Packed batches of a data set for one rank, epoch by epoch, in ``num_workers`` DataLoader processes.

    ``set_epoch(e, start_batch=k)`` returns an iterable over batches ``k, k + 1, ...`` of epoch ``e`` (nothing before
    ``k`` is decoded: a run resumed mid-epoch continues exactly); ``len(loader)`` is the number of batches of the
    last epoch set. Training epochs all have :meth:`steps` batches.

    Args:
        source: a map-style data set of ``(image, label)`` (see the module docstring).
        opts: :class:`NativeOptions`.
        seed, rank, world_size: the plan's.
        train: training (shuffled, sampled budgets, fixed epoch length) or evaluation (every image once).
        num_workers, pin_memory: for the DataLoader.
    """

    def __init__(self, source: Dataset, opts: NativeOptions, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 train: bool = True, num_workers: int = 0, pin_memory: bool = False) -> None:
        self.source, self.opts = source, opts
        self.seed, self.rank, self.world_size, self.train = int(seed), int(rank), int(world_size), bool(train)
        self.num_workers, self.pin_memory = int(num_workers), bool(pin_memory)
        self._steps: Optional[int] = None
        self._epoch, self._plan = -1, None

    def steps(self) -> int:
        """Batches of every training epoch: those that this rank's share of the images fills at the expected
        budget per image (at least 1)."""
        if self._steps is None:
            o = self.opts
            mean_tokens = (o.min_tokens + o.max_image_tokens) / 2
            per_row = max(1, int(o.seq_len // mean_tokens))  # whole images per row, on average
            if o.max_images is not None:
                per_row = min(per_row, o.max_images)
            mine = len(range(self.rank, len(self.source), self.world_size))
            self._steps = max(1, mine // (per_row * o.rows))
        return self._steps

    def plan(self, epoch: int) -> Plan:
        if epoch != self._epoch:
            self._plan = plan_epoch(len(self.source), self.opts, seed=self.seed, epoch=epoch, rank=self.rank,
                                    world_size=self.world_size, train=self.train,
                                    steps=self.steps() if self.train else None)
            self._epoch = epoch
        return self._plan  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.plan(max(self._epoch, 0)))

    def set_epoch(self, epoch: int, start_batch: int = 0) -> "_Batches":
        plan = self.plan(epoch)
        if not 0 <= start_batch <= len(plan):
            raise ValueError(f"start_batch {start_batch} is outside the epoch's {len(plan)} batches")
        ds = NativeBatches(self.source, self.opts, plan, seed=self.seed, epoch=epoch, train=self.train)
        # its own generator: creating the iterator then draws nothing from the global RNG, whose state a resumed run
        # restores from its checkpoint (the batches' own draws are seeded per image)
        return _Batches(DataLoader(ds, batch_size=None, sampler=range(start_batch, len(plan)),
                                   num_workers=self.num_workers, collate_fn=_first, pin_memory=self.pin_memory,
                                   generator=torch.Generator().manual_seed(self.seed)))

    def __iter__(self) -> Iterator[PackedBatch]:
        return iter(self.set_epoch(max(self._epoch, 0)))
