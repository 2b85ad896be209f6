"""The trainer's view of prepared data: windows over the token stream, batches, the eval set.

Training reads a split's token stream as windows of seq_len+1 tokens at stride seq_len (inputs
and shifted targets), in an order shuffled per epoch from the seed. The loader's position is a
single world-size independent integer, the number of windows consumed globally, so it goes into
the checkpoint and a resumed run sees exactly the batches the uninterrupted run would have seen.

Torch is imported lazily, where tensors are made.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from m3run.runner.data.manifest import DTYPES, FORMAT_VERSION, DataError, is_int, load_manifest
from m3run.runner.data.verify import verify_split

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchLoader",
    "TokenWindows",
    "WindowStream",
    "check_vocab",
    "epoch_permutation",
    "eval_batches",
]


class TokenWindows:
    """A split's shards, memory-mapped as one token stream, viewed as training windows.

    Window i covers tokens [i·seq_len, i·seq_len + seq_len + 1): inputs and their next-token
    targets. Consecutive windows share one token, so every token is a target exactly once.
    """

    def __init__(self, split_dir: str | Path, seq_len: int, *, verify: bool = False):
        if not is_int(seq_len) or seq_len < 1:
            raise DataError(f"seq_len={seq_len!r} must be an integer ≥ 1")
        self.split_dir = Path(split_dir)
        self.seq_len = seq_len
        self.manifest = load_manifest(self.split_dir, verify=verify)
        dtype = DTYPES[self.manifest["dtype"]]
        shards = [s for s in self.manifest["shards"] if s["tokens"] > 0]
        self._maps = [np.memmap(self.split_dir / s["file"], dtype=dtype, mode="r") for s in shards]
        self._starts = np.cumsum([0] + [s["tokens"] for s in shards], dtype=np.int64)
        self.num_tokens = int(self._starts[-1])
        self._n = (self.num_tokens - 1) // seq_len
        if self._n < 1:
            raise DataError(
                f"the data at {self.split_dir} has {self.num_tokens} tokens; one window of "
                f"seq_len {seq_len} needs {seq_len + 1}: prepare more data or lower seq_len"
            )

    def __len__(self) -> int:
        return self._n

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream, as int64."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            shard_lo = int(self._starts[k])
            take = min(stop, int(self._starts[k + 1])) - pos
            out[pos - start : pos - start + take] = self._maps[k][
                pos - shard_lo : pos - shard_lo + take
            ]
            pos += take
            k += 1
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._n:
            raise IndexError(f"window {i} outside [0, {self._n})")
        start = i * self.seq_len
        return self.tokens(start, start + self.seq_len + 1)

    def batch(self, indices: Sequence[int]) -> np.ndarray:
        """Windows stacked as (len(indices), seq_len + 1) int64."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            out[row] = self[int(i)]
        return out

    def close(self) -> None:
        # Dropping the memmaps unmaps the files (numpy has no explicit close).
        self._maps = []


def _to_tensors(windows: np.ndarray, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
    if pin:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


class _Prefetcher:
    """A thread producing batches for stream positions start, start+step, ... into a queue."""

    def __init__(self, produce: Callable[[int], Any], start: int, step: int, depth: int):
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(start, step), name="m3run-batch-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, pos: int, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (pos, self._produce(pos), None)
            except BaseException as e:  # handed to the consumer, which re-raises it
                item = (pos, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            pos += step

    def get(self) -> tuple[int, Any]:
        while True:
            try:
                pos, batch, err = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the batch prefetch thread stopped unexpectedly") from None
        if err is not None:
            raise err
        return pos, batch

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)


class WindowStream:
    """The machinery every training loader shares: a global stream of windows consumed in
    blocks of micro_batch_size·world_size (rank r takes the r-th micro_batch_size slice of each
    block), a prefetch thread, skip and close. The position (windows consumed globally) is
    independent of world size and counts only batches returned by next_batch().

    A subclass says which windows fill a batch (`_rows`) and what its state is.
    """

    def __init__(
        self,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        prefetch: int,
        pin_memory: bool,
    ):
        for name, value, lo in (
            ("micro_batch_size", micro_batch_size, 1),
            ("world_size", world_size, 1),
            ("seed", seed, 0),
            ("prefetch", prefetch, 0),
        ):
            if not is_int(value) or value < lo:
                raise DataError(f"{name}={value!r} must be an integer ≥ {lo}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise DataError(f"rank={rank!r} must be an integer in [0, world_size={world_size})")
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._block = micro_batch_size * world_size
        self._depth = prefetch
        self._pin = bool(pin_memory) and self._cuda_available()
        self._consumed = 0
        self._prefetcher: _Prefetcher | None = None
        self._held: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # peek_batch's
        self._lock = threading.RLock()
        self._closed = False

    @staticmethod
    def _cuda_available() -> bool:
        import torch

        if torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True ignored: CUDA is not available", stacklevel=4)
        return False

    @property
    def windows_consumed(self) -> int:
        return self._consumed

    @property
    def manifests(self) -> list[dict]:
        """The manifest of every split read, in source order (all share one tokenizer)."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        return int(self.manifests[0]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifests[0]["eos_id"])

    def _rows(self, position: int) -> np.ndarray:
        """This rank's (micro_batch_size, seq_len + 1) windows of the block at `position`."""
        raise NotImplementedError

    def _produce(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _to_tensors(self._rows(position), self._pin)

    def tokens_by_source(self) -> dict[str, int] | None:
        """Target tokens drawn so far from each source, for the metrics; None with one source."""
        return None

    # -- the trainer's API ---------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both int64 (micro_batch_size, seq_len); y[:, t] is the token after x[:, t]."""
        with self._lock:
            batch = self.peek_batch()
            self._held = None
            self._consumed += self._block
            return batch

    def peek_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch next_batch() returns next, read now but not consumed: the position, and
        with it the state a checkpoint saves, stays where it is."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__}: a batch read after close()")
            if self._held is not None and self._held[0] == self._consumed:
                return self._held[1]
            if self._depth == 0:
                batch = self._produce(self._consumed)
            else:
                if self._prefetcher is None:
                    self._prefetcher = _Prefetcher(
                        self._produce, self._consumed, self._block, self._depth
                    )
                try:
                    pos, batch = self._prefetcher.get()
                except BaseException:
                    self._stop_prefetch()  # a retry starts a fresh prefetcher at this position
                    raise
                if pos != self._consumed:
                    raise RuntimeError(
                        f"prefetched batch for window {pos}, expected {self._consumed}"
                    )
            self._held = (self._consumed, batch)
            return batch

    def skip(self, n_micro_batches: int) -> None:
        """Advance as if n batches had been read and discarded, without reading them."""
        if not is_int(n_micro_batches) or n_micro_batches < 0:
            raise ValueError(f"skip({n_micro_batches!r}): the count must be an integer ≥ 0")
        with self._lock:
            self._stop_prefetch()
            self._consumed += n_micro_batches * self._block

    def _close_data(self) -> None:
        """Release the memory maps."""

    def close(self) -> None:
        with self._lock:
            self._stop_prefetch()
            self._close_data()
            self._closed = True

    def _stop_prefetch(self) -> None:
        """Before the position jumps (skip, a loaded state) or the stream closes: no batch read
        for the old position is handed out."""
        self._held = None
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __enter__(self) -> WindowStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BatchLoader(WindowStream):
    """Shuffled training batches from one prepared split, resumable to the exact batch.

    The global stream visits windows in a permutation drawn from PCG64 seeded with
    (seed, epoch); after the last window of an epoch the next epoch starts with a fresh
    permutation. Blocks, ranks and the position: `WindowStream`.
    """

    def __init__(
        self,
        split_dir: str | Path,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        pin_memory: bool = False,
        verify_cache: Path | None = None,
    ):
        super().__init__(seq_len, micro_batch_size, seed, rank, world_size, prefetch, pin_memory)
        self.windows = TokenWindows(split_dir, seq_len)
        # Content and token ids of this rank's share of the shards, before any batch is read.
        verify_split(self.windows.split_dir, self.windows.manifest, rank, world_size, verify_cache)
        self._perms: dict[int, np.ndarray] = {}

    # -- facts about the data ------------------------------------------------------------------
    @property
    def manifests(self) -> list[dict]:
        return [self.windows.manifest]

    @property
    def num_tokens(self) -> int:
        return self.windows.num_tokens

    @property
    def num_windows(self) -> int:
        return len(self.windows)

    @property
    def epoch(self) -> int:
        return self._consumed // len(self.windows)

    # -- order ---------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(len(self.windows), self.seed, epoch)
            # Keep the previous epoch too: a batch can straddle an epoch boundary.
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def _window_indices(self, position: int) -> list[int]:
        n = len(self.windows)
        first = position + self.rank * self.micro_batch_size
        out = []
        for p in range(first, first + self.micro_batch_size):
            out.append(int(self._permutation(p // n)[p % n]))
        return out

    def _rows(self, position: int) -> np.ndarray:
        return self.windows.batch(self._window_indices(position))

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """Plain ints: the position after the last batch returned (not the prefetched ones)."""
        with self._lock:
            return {
                "format_version": FORMAT_VERSION,
                "seed": self.seed,
                "seq_len": self.seq_len,
                "num_windows": len(self.windows),
                "windows_consumed": self._consumed,
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            for key in ("seed", "seq_len", "num_windows", "windows_consumed"):
                if not is_int(state.get(key)):
                    raise DataError(
                        f"data-loader state is missing integer {key!r} (got {state!r}): the "
                        "checkpoint is not from this m3run; resume from another checkpoint"
                    )
            for key in ("seed", "seq_len", "num_windows"):
                if state[key] != getattr(self, key):
                    raise DataError(
                        f"checkpoint data position was recorded with {key}={state[key]}, this "
                        f"run has {key}={getattr(self, key)} (data at {self.windows.split_dir}): "
                        "resume with the config and data the run started with, or start a new run"
                    )
            if state["windows_consumed"] < 0:
                raise DataError(f"data-loader windows_consumed={state['windows_consumed']} < 0")
            self._stop_prefetch()
            self._consumed = state["windows_consumed"]

    def _close_data(self) -> None:
        self.windows.close()


def epoch_permutation(n: int, seed: int, epoch: int, source: int = 0) -> np.ndarray:
    """The order of n windows in one epoch. Source 0 of a mixture draws what a single-source
    run draws, so a one-source mixture reads exactly the windows `data.train_path` reads."""
    key = [seed, epoch] if source == 0 else [seed, epoch, source]
    return np.random.Generator(np.random.PCG64(key)).permutation(n)


def eval_batches(
    split_dir: str | Path, seq_len: int, micro_batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: up to n_batches batches of windows spread evenly over the split.

    Depends only on the data and the shapes (not on a seed or training state), so every eval
    of a run, and of a resumed run, scores the same tokens. Returns fewer batches when the split
    has fewer than n_batches·micro_batch_size windows; only full batches.
    """
    if not is_int(micro_batch_size) or micro_batch_size < 1:
        raise DataError(f"micro_batch_size={micro_batch_size!r} must be an integer ≥ 1")
    if not is_int(n_batches) or n_batches < 1:
        raise DataError(f"n_batches={n_batches!r} must be an integer ≥ 1")
    windows = TokenWindows(split_dir, seq_len)
    try:
        verify_split(windows.split_dir, windows.manifest)
        n = len(windows)
        if n < micro_batch_size:
            raise DataError(
                f"the data at {split_dir} has {n} windows of {seq_len + 1} tokens; one eval "
                f"batch needs {micro_batch_size}: lower micro_batch_size or seq_len, or prepare "
                "with a larger val_fraction"
            )
        k = min(n_batches * micro_batch_size, (n // micro_batch_size) * micro_batch_size)
        picks = (np.arange(k, dtype=np.int64) * n) // k
        return [
            _to_tensors(windows.batch(picks[b : b + micro_batch_size]), pin=False)
            for b in range(0, k, micro_batch_size)
        ]
    finally:
        windows.close()


def check_vocab(
    manifest_or_loader: dict | WindowStream | TokenWindows, model_vocab_size: int
) -> None:
    """Raise DataError when the data's token ids may not fit the model's embedding."""
    if isinstance(manifest_or_loader, dict):
        data_vocab = manifest_or_loader["vocab_size"]
        spec = manifest_or_loader.get("tokenizer", {}).get("spec", "?")
    elif isinstance(manifest_or_loader, TokenWindows):
        data_vocab = manifest_or_loader.manifest["vocab_size"]
        spec = manifest_or_loader.manifest["tokenizer"].get("spec", "?")
    else:
        data_vocab = manifest_or_loader.vocab_size
        spec = manifest_or_loader.manifests[0]["tokenizer"].get("spec", "?")
    if data_vocab > model_vocab_size:
        raise DataError(
            f"the data's vocabulary ({data_vocab} tokens, tokenizer {spec}) is larger than the "
            f"model's vocab_size {model_vocab_size}: set model.vocab_size ≥ {data_vocab}, or "
            f"re-run `m3run prepare-data` with a smaller tokenizer (e.g. "
            f"--tokenizer bpe:{model_vocab_size})"
        )
