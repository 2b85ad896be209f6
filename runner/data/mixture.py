"""A token-weighted mixture of prepared sources, in a deterministic, exactly resumable order.

Every window holds seq_len + 1 tokens whatever its source, so token proportions are window
proportions. Which source fills each slot of the global stream is stride scheduling (Waldspurger
and Weihl, 1995): the next slot goes to the source whose pass value (windows drawn + 1) / weight
is smallest, ties to the lower index. Over any prefix of the stream a source's share is within
one window of its weight's share: no sampling noise, and the choice depends only on the
per-source counts, which are the loader's whole state. Inside a source, windows follow a
permutation per epoch drawn from the seed (`epoch_permutation`). A source with `max_epochs`
leaves the mix once it has been read that many times; the others share its slots by weight.

The checkpointed state holds the global position, the per-source counts and a fingerprint of
the mixture (each source's manifest sha256, weight and epoch cap). A resume under another
fingerprint is an error unless forced; forced, the counts are re-derived for the new mixture at
the same global position, and the change is logged.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from m3run.runner.data.loader import BatchLoader, TokenWindows, WindowStream, epoch_permutation
from m3run.runner.data.manifest import FORMAT_VERSION, MANIFEST_NAME, DataError, is_int
from m3run.runner.data.verify import verify_split

__all__ = ["MixtureLoader", "Source", "StrideSchedule", "train_loader"]

_KNOWN_POSITIONS = 256  # cached (position → counts) points; the loader only moves forward


@dataclass(frozen=True)
class Source:
    """One prepared split in the mix (what `data.sources` lists)."""

    path: str
    weight: float
    max_epochs: float | None = None
    name: str | None = None


class StrideSchedule:
    """Which source fills each slot: counts at any position, by simulation from a known one."""

    def __init__(self, weights: Sequence[float], caps: Sequence[int | None]):
        self.weights = [float(w) for w in weights]
        self.caps = list(caps)
        self._lock = threading.Lock()
        self._anchor = 0
        self._known: dict[int, tuple[int, ...]] = {0: (0,) * len(self.weights)}

    def reset(self, position: int, counts: Sequence[int]) -> None:
        with self._lock:
            self._anchor = position
            self._known = {position: tuple(counts)}

    def _next(self, counts: list[int], position: int) -> int:
        best, best_pass = -1, math.inf
        for i, w in enumerate(self.weights):
            cap = self.caps[i]
            if cap is not None and counts[i] >= cap:
                continue
            p = (counts[i] + 1) / w
            if p < best_pass:
                best, best_pass = i, p
        if best < 0:
            raise DataError(
                f"every data source has reached its max_epochs after {position} windows: raise "
                "data.sources[*].max_epochs (or drop it), or lower train.total_steps"
            )
        return best

    def _advance(self, counts: list[int], start: int, n: int) -> list[tuple[int, int]]:
        """n slots from `start` with `counts` at start (updated in place): (source, k)."""
        out = []
        for j in range(n):
            s = self._next(counts, start + j)
            out.append((s, counts[s]))
            counts[s] += 1
        return out

    def counts_at(self, position: int) -> tuple[int, ...]:
        with self._lock:
            if position < self._anchor:
                raise ValueError(f"position {position} is before the restored {self._anchor}")
            base = max(p for p in self._known if p <= position)
            counts = list(self._known[base])
            self._advance(counts, base, position - base)
            self._remember(position, counts)
            return tuple(counts)

    def slots(self, start: int, n: int) -> list[tuple[int, int]]:
        counts = list(self.counts_at(start))
        out = self._advance(counts, start, n)
        with self._lock:
            self._remember(start + n, counts)
        return out

    def _remember(self, position: int, counts: list[int]) -> None:
        self._known[position] = tuple(counts)
        while len(self._known) > _KNOWN_POSITIONS:
            oldest = next(p for p in self._known if p != self._anchor)
            del self._known[oldest]

    def derive(self, position: int) -> tuple[int, ...]:
        """The counts this schedule reaches at `position` from 0: proportional shares, then the
        few slots left by the stride rule; with epoch caps, by simulation."""
        counts = [0] * len(self.weights)
        total = sum(self.weights)
        if all(c is None for c in self.caps):
            counts = [math.floor(position * w / total) for w in self.weights]
        self._advance(counts, sum(counts), position - sum(counts))
        return tuple(counts)


def _tokenizer_identity(manifest: dict) -> str | None:
    """The same tokenizer under any name: a tokenizer.json by its sha256, tiktoken by name."""
    tok = manifest["tokenizer"]
    return tok.get("sha256") or tok.get("name")


def _manifest_sha256(split_dir: Path) -> str:
    return hashlib.sha256((split_dir / MANIFEST_NAME).read_bytes()).hexdigest()


def _check_source(i: int, s: Source) -> None:
    where = f"data.sources[{i}] ({s.path})"
    if not (isinstance(s.weight, int | float) and math.isfinite(s.weight) and s.weight > 0):
        raise DataError(f"{where}: weight {s.weight!r} must be a number > 0, e.g. 0.2")
    if s.max_epochs is not None and not (math.isfinite(s.max_epochs) and s.max_epochs > 0):
        raise DataError(f"{where}: max_epochs {s.max_epochs!r} must be > 0, or null for no cap")


class MixtureLoader(WindowStream):
    """Training batches drawn from several prepared splits by token weight; see the module doc.

    `force`: accept a checkpoint written under another mixture, re-deriving the per-source
    positions (reported through `log`).
    """

    def __init__(
        self,
        sources: Sequence[Source],
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        pin_memory: bool = False,
        verify_cache: Path | None = None,
        force: bool = False,
        log: Callable[[str], None] = print,
    ):
        super().__init__(seq_len, micro_batch_size, seed, rank, world_size, prefetch, pin_memory)
        if not sources:
            raise DataError("data.sources is empty: list at least one prepared split")
        for i, s in enumerate(sources):
            _check_source(i, s)
        self.sources = list(sources)
        self.force = force
        self.log = log
        self.windows: list[TokenWindows] = []
        for s in self.sources:
            w = TokenWindows(s.path, seq_len)
            verify_split(w.split_dir, w.manifest, rank, world_size, verify_cache)
            self.windows.append(w)
        self._check_one_tokenizer()
        self.names = self._names()
        caps = [
            None if s.max_epochs is None else max(1, math.floor(s.max_epochs * len(w)))
            for s, w in zip(self.sources, self.windows, strict=True)
        ]
        self.schedule = StrideSchedule([s.weight for s in self.sources], caps)
        self.fingerprint = hashlib.sha256(
            json.dumps(self._identity(), sort_keys=True).encode()
        ).hexdigest()
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _check_one_tokenizer(self) -> None:
        first = self.windows[0].manifest
        for i, w in enumerate(self.windows[1:], 1):
            m = w.manifest
            if (m["vocab_size"], m["eos_id"], _tokenizer_identity(m)) != (
                first["vocab_size"],
                first["eos_id"],
                _tokenizer_identity(first),
            ):
                raise DataError(
                    f"data.sources[{i}] ({w.split_dir}) was prepared with tokenizer "
                    f"{m['tokenizer'].get('spec')!r} (vocab {m['vocab_size']}), "
                    f"data.sources[0] ({self.windows[0].split_dir}) with "
                    f"{first['tokenizer'].get('spec')!r} (vocab {first['vocab_size']}): prepare "
                    "every source with the same --tokenizer (a trained bpe: pass its "
                    "tokenizer.json to the others)"
                )

    def _names(self) -> list[str]:
        names = []
        for s, w in zip(self.sources, self.windows, strict=True):
            # …/fineweb-edu/train → fineweb-edu
            default = w.split_dir.parent.name if w.split_dir.name == "train" else w.split_dir.name
            names.append(s.name or default or s.path)
        if len(set(names)) != len(names):
            raise DataError(
                f"data.sources have the same name twice ({', '.join(names)}): give each a "
                "distinct `name`"
            )
        return names

    def _identity(self) -> list[dict]:
        return [
            {
                "manifest_sha256": _manifest_sha256(w.split_dir),
                "weight": s.weight,
                "max_epochs": s.max_epochs,
            }
            for s, w in zip(self.sources, self.windows, strict=True)
        ]

    # -- facts about the data ------------------------------------------------------------------
    @property
    def manifests(self) -> list[dict]:
        return [w.manifest for w in self.windows]

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.windows)

    @property
    def num_windows(self) -> int:
        return sum(len(w) for w in self.windows)

    def counts(self) -> tuple[int, ...]:
        """Windows drawn from each source up to the position (batches handed out)."""
        return self.schedule.counts_at(self._consumed)

    def tokens_by_source(self) -> dict[str, int]:
        return {n: c * self.seq_len for n, c in zip(self.names, self.counts(), strict=True)}

    # -- order ---------------------------------------------------------------------------------
    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        perm = self._perms.get((source, epoch))
        if perm is None:
            perm = epoch_permutation(len(self.windows[source]), self.seed, epoch, source)
            # Keep the previous epoch of each source: a batch can straddle a boundary.
            self._perms = {
                k: p for k, p in self._perms.items() if k[0] != source or k[1] >= epoch - 1
            }
            self._perms[(source, epoch)] = perm
        return perm

    def picks(self, position: int, n: int) -> list[tuple[int, int]]:
        """(source, window index) of the n global slots from `position`."""
        out = []
        for s, k in self.schedule.slots(position, n):
            size = len(self.windows[s])
            out.append((s, int(self._permutation(s, k // size)[k % size])))
        return out

    def _rows(self, position: int) -> np.ndarray:
        first = position + self.rank * self.micro_batch_size
        out = np.empty((self.micro_batch_size, self.seq_len + 1), dtype=np.int64)
        for row, (s, i) in enumerate(self.picks(first, self.micro_batch_size)):
            out[row] = self.windows[s][i]
        return out

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain values: the position, the per-source counts and the mixture's fingerprint."""
        with self._lock:
            counts = self.counts()
            return {
                "format_version": FORMAT_VERSION,
                "kind": "mixture",
                "seed": self.seed,
                "seq_len": self.seq_len,
                "windows_consumed": self._consumed,
                "fingerprint": self.fingerprint,
                "sources": [
                    {
                        "name": name,
                        "path": str(w.split_dir),
                        "weight": s.weight,
                        "max_epochs": s.max_epochs,
                        "num_windows": len(w),
                        "windows": c,
                        "epoch": c // len(w),
                    }
                    for name, s, w, c in zip(
                        self.names, self.sources, self.windows, counts, strict=True
                    )
                ],
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            for key in ("seed", "seq_len", "windows_consumed"):
                if not is_int(state.get(key)) or state[key] < 0:
                    raise DataError(
                        f"data-loader state is missing integer {key!r} (got {state!r}): the "
                        "checkpoint is not from this m3run; resume from another checkpoint"
                    )
            for key in ("seed", "seq_len"):
                if state[key] != getattr(self, key):
                    raise DataError(
                        f"checkpoint data position was recorded with {key}={state[key]}, this "
                        f"run has {key}={getattr(self, key)}: resume with the config the run "
                        "started with, or start a new run"
                    )
            position = state["windows_consumed"]
            self._stop_prefetch()
            if state.get("kind") == "mixture" and state.get("fingerprint") == self.fingerprint:
                counts = [src.get("windows") for src in state["sources"]]
                if not all(is_int(c) for c in counts) or sum(counts) != position:
                    raise DataError(
                        f"data-loader state is inconsistent (per-source windows {counts} do not "
                        f"add up to windows_consumed={position}): resume from another checkpoint"
                    )
            else:
                was = _describe_state(state)
                if not self.force:
                    raise DataError(
                        f"the checkpoint's data position belongs to another data mix ({was}); "
                        f"this run reads {self._describe()}: resume with the data.sources the "
                        "run was started with, or pass --force to re-derive each source's "
                        f"position for this mix at global window {position}"
                    )
                counts = list(self.schedule.derive(position))
                self.log(
                    f"warning: data mix changed (--force): was {was}; now {self._describe()}; "
                    f"per-source positions re-derived at window {position}: "
                    + ", ".join(f"{n}={c}" for n, c in zip(self.names, counts, strict=True))
                )
            self.schedule.reset(position, counts)
            self._consumed = position

    def _describe(self) -> str:
        return ", ".join(
            f"{n} (weight {s.weight}, {w.split_dir})"
            for n, s, w in zip(self.names, self.sources, self.windows, strict=True)
        )

    def _close_data(self) -> None:
        for w in self.windows:
            w.close()


def _describe_state(state: dict) -> str:
    if state.get("kind") != "mixture":
        return "one source (data.train_path)"
    parts = [f"{s.get('name')} (weight {s.get('weight')})" for s in state.get("sources", [])]
    return ", ".join(parts) or "no sources"


def train_loader(
    train_path: str | None,
    sources: Sequence[Any] | None,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    **kwargs: Any,
) -> WindowStream:
    """The training loader of a `data` config: one split (`train_path`, a BatchLoader) or a
    mixture (`sources`: items with path, weight, max_epochs and name). kwargs: rank,
    world_size, prefetch, pin_memory, and for a mixture force."""
    if sources is None:
        kwargs.pop("force", None)
        if train_path is None:
            raise DataError("no training data: set data.train_path or data.sources")
        return BatchLoader(train_path, seq_len, micro_batch_size, seed, **kwargs)
    mix = [Source(s.path, s.weight, s.max_epochs, s.name) for s in sources]
    return MixtureLoader(mix, seq_len, micro_batch_size, seed, **kwargs)
