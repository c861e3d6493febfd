"""Batch samplers: deterministic given a seed, resumable mid-epoch, sharded across ranks.

`TokenBudgetBatcher` (translation, classification): fairseq's ``--max-tokens`` batching
(``fairseq/data/data_utils.py``, ``batch_by_size``). Each epoch the examples are shuffled, stably
sorted by length bucket (``length // bucket_width``, so equal buckets keep the random order), cut
greedily into batches with ``batch_size * max_length_in_batch <= max_tokens`` (the budget counts
padding), and the batch order is shuffled. Everything is a function of (seed, epoch): no global RNG.

    global order of epoch e:   B0 B1 B2 B3 B4 B5 ...      (len divisible by multiple_of)
    rank 0 of 2:               B0    B2    B4    ...      rank r takes B[r::world_size]
    rank 1 of 2:                  B1    B3    B5 ...

So a step of W ranks sees the batches a single process sees in W accumulation micro-steps. The
number of batches is made divisible by ``multiple_of`` (default ``world_size``) by halving the
largest batches, so every rank takes the same number of steps and no example is dropped. Pass
``multiple_of = world_size * grad_accum`` (or any common multiple) to give single-process and
multi-process runs the same global order.

`LMBatcher` (character LM): nanoGPT's ``get_batch``, random windows of ``context + 1`` tokens.
The windows of step s are drawn from a generator seeded with (seed, s), so the state is the step.
With W ranks each takes its contiguous slice of the global batch.

State (``state_dict`` / ``load_state_dict``) is the epoch and the global batches consumed in it
(resp. the step), plus a fingerprint of the settings that shape the order; loading into a sampler
whose settings differ raises instead of silently giving other batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must lie in 0..world_size-1 (world_size {world_size})")


def _check_fingerprint(saved: dict, current: dict, what: str) -> None:
    bad = [
        f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in current.items() if saved.get(k) != v
    ]
    if bad:
        raise ValueError(
            f"{what} state was saved with other settings, so the batches would differ: "
            + "; ".join(bad)
        )


class TokenBudgetBatcher:
    """Yields lists of example indices for this rank, one epoch per ``iter()``, then advances
    the epoch. `lengths[i]` is example i's padded length as collated (see
    `attnlab.data.collate.translation_lengths`)."""

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        seed: int = 0,
        shuffle: bool = True,
        bucket_width: int = 1,
        max_batch_size: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        multiple_of: int | None = None,
    ) -> None:
        _check_rank(rank, world_size)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        multiple_of = world_size if multiple_of is None else multiple_of
        problems = []
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            problems.append("lengths must be a non-empty list of ints")
        elif self.lengths.min() < 1:
            problems.append(f"lengths must be >= 1 (found {self.lengths.min()})")
        elif self.lengths.max() > max_tokens:
            long = int((self.lengths > max_tokens).sum())
            problems.append(
                f"{long} example(s) are longer than max_tokens ({max_tokens}), the longest "
                f"{self.lengths.max()} tokens: filter them out or raise max_tokens"
            )
        if bucket_width < 1:
            problems.append(f"bucket_width ({bucket_width}) must be >= 1")
        if max_batch_size is not None and max_batch_size < 1:
            problems.append(f"max_batch_size ({max_batch_size}) must be >= 1 or None")
        if multiple_of < 1 or multiple_of % world_size:
            problems.append(
                f"multiple_of ({multiple_of}) must be a multiple of world_size ({world_size})"
            )
        elif len(self.lengths) < multiple_of:
            problems.append(f"{len(self.lengths)} examples cannot fill {multiple_of} batches")
        if problems:
            raise ValueError("TokenBudgetBatcher: " + "; ".join(problems))
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        self.bucket_width, self.max_batch_size = bucket_width, max_batch_size
        self.rank, self.world_size, self.multiple_of = rank, world_size, multiple_of
        self.epoch, self.position = 0, 0  # position: global batches consumed in this epoch
        self._cache: tuple[int, list[list[int]]] | None = None

    def global_batches(self, epoch: int) -> list[list[int]]:
        """The batches of all ranks for `epoch`, in order."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(n) if self.shuffle else np.arange(n)
        order = perm[np.argsort(self.lengths[perm] // self.bucket_width, kind="stable")]
        batches, current, longest = [], [], 0
        for i in order.tolist():
            length = max(longest, int(self.lengths[i]))
            full = self.max_batch_size is not None and len(current) >= self.max_batch_size
            if current and (full or (len(current) + 1) * length > self.max_tokens):
                batches.append(current)
                current, length = [], int(self.lengths[i])
            current.append(i)
            longest = length
        batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        while len(batches) % self.multiple_of:  # halve the largest batch (first among equals)
            j = max(range(len(batches)), key=lambda k: len(batches[k]))
            if len(batches[j]) < 2:
                raise ValueError(
                    f"{len(batches)} single-example batches cannot be split into a multiple of "
                    f"{self.multiple_of}: raise max_tokens (now {self.max_tokens})"
                )
            half = len(batches[j]) // 2
            batches[j : j + 1] = [batches[j][:half], batches[j][half:]]
        self._cache = (epoch, batches)
        return batches

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch."""
        return len(self.global_batches(self.epoch)) // self.world_size

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.global_batches(self.epoch)
        if self.position >= len(batches):  # state saved just after an epoch's last batch
            self.epoch, self.position = self.epoch + 1, 0
            batches = self.global_batches(self.epoch)
        while self.position < len(batches):
            batch = batches[self.position + self.rank]
            self.position += self.world_size  # before yield: a state saved now resumes after it
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def _fingerprint(self) -> dict:
        return {
            "lengths_sha256": hashlib.sha256(self.lengths.tobytes()).hexdigest(),
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "bucket_width": self.bucket_width,
            "max_batch_size": self.max_batch_size,
            "multiple_of": self.multiple_of,
        }

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        _check_fingerprint(state, self._fingerprint(), "TokenBudgetBatcher")
        if state["position"] % self.world_size:
            raise ValueError(
                f"TokenBudgetBatcher state is {state['position']} batches into epoch "
                f"{state['epoch']}, not a multiple of world_size ({self.world_size})"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class LMBatcher:
    """Endless random windows of a 1-D token tensor: dicts with ``input_ids`` and ``labels``
    (the window shifted by one), each (batch_size // world_size, context)."""

    def __init__(
        self,
        data: torch.Tensor,
        context: int,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        _check_rank(rank, world_size)
        if data.ndim != 1 or len(data) <= context:
            raise ValueError(
                f"data must be 1-D and longer than context ({context}), got shape {tuple(data.shape)}"
            )
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"batch_size ({batch_size}) is the global batch: it must be a positive multiple "
                f"of world_size ({world_size})"
            )
        self.data, self.context, self.batch_size, self.seed = data, context, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.step = 0

    def starts(self, step: int) -> np.ndarray:
        """Window starts of the global batch of `step`, uniform in [0, len - context) as nanoGPT."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.data) - self.context, size=self.batch_size)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's batch of `step` (a pure function of the settings and `step`)."""
        per_rank = self.batch_size // self.world_size
        mine = self.starts(step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        idx = torch.as_tensor(mine)[:, None] + torch.arange(self.context + 1)  # (b, T+1)
        windows = self.data[idx]
        return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def _fingerprint(self) -> dict:
        return {"seed": self.seed, "context": self.context, "batch_size": self.batch_size,
                "data_len": len(self.data)}  # fmt: skip

    def state_dict(self) -> dict:
        return {"step": self.step, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        _check_fingerprint(state, self._fingerprint(), "LMBatcher")
        self.step = int(state["step"])
