"""Tokenizers: tiktoken's `gpt2`, a HF tokenizer.json by path, or a byte-level BPE trained here.

`Tokenizer` wraps either backend behind the few operations data preparation needs; when tiktoken
cannot download its encoding the error says which files to provide and where. Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from m3run.runner.data.manifest import DataError, load_manifest

__all__ = [
    "EOS_CANDIDATES",
    "EOS_TEXT",
    "Tokenizer",
    "load_tokenizer",
    "parse_bpe_spec",
    "train_bpe",
]

EOS_TEXT = "<|endoftext|>"
# EOS names tried, in order, when a HF tokenizer.json is given by path.
EOS_CANDIDATES = (EOS_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# tiktoken caches each downloaded file under sha1(url) in $TIKTOKEN_CACHE_DIR; these are the two
# files its `gpt2` encoding reads (tiktoken_ext/openai_public.py).
_GPT2_FILES = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


class Tokenizer:
    """A loaded tokenizer with the few operations data preparation needs.

    `kind` is "tiktoken" (source: an encoding name, only "gpt2") or "hf" (source: the path of a
    HF `tokenizer.json`). Text that happens to contain a special token's string (for example a
    literal "<|endoftext|>") is encoded as plain text: EOS only ever separates documents.
    """

    def __init__(self, kind: str, source: str, backend: Any, vocab_size: int, eos_id: int):
        self.kind = kind
        self.source = source
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._backend = backend

    @classmethod
    def load(cls, kind: str, source: str) -> Tokenizer:
        if kind == "tiktoken":
            return cls._load_tiktoken(source)
        if kind == "hf":
            return cls._load_hf(source)
        raise DataError(f"unknown tokenizer kind {kind!r}: expected 'tiktoken' or 'hf'")

    @classmethod
    def _load_tiktoken(cls, name: str) -> Tokenizer:
        if name != "gpt2":
            raise DataError(
                f"unsupported tiktoken encoding {name!r}: only 'gpt2' is supported; "
                "pass a tokenizer.json path or bpe:<vocab_size> for anything else"
            )
        import tiktoken

        try:
            enc = tiktoken.get_encoding(name)
        # tiktoken downloads on first use; offline it raises requests, urllib or OS errors
        # depending on the version, so every failure becomes the same actionable message.
        except Exception as e:
            raise DataError(_tiktoken_offline_message(e)) from e
        return cls("tiktoken", name, enc, enc.n_vocab, enc.eot_token)

    @classmethod
    def _load_hf(cls, path: str) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        if not Path(path).is_file():
            raise DataError(
                f"tokenizer file not found: {path}: pass the path of a HF tokenizer.json, "
                "`gpt2`, or `bpe:<vocab_size>`"
            )
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise DataError(
                f"cannot read tokenizer file {path} ({e}): it must be a HF tokenizer.json "
                "(as saved by `tokenizers`), e.g. the one a `bpe:<vocab_size>` run saved"
            ) from e
        tok.encode_special_tokens = True
        vocab = tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"tokenizer file {path} has an empty vocabulary: use another one")
        eos_id = next((vocab[name] for name in EOS_CANDIDATES if name in vocab), None)
        if eos_id is None:
            raise DataError(
                f"tokenizer file {path} has no end-of-text token (looked for "
                f"{', '.join(EOS_CANDIDATES)}): add {EOS_TEXT!r} as a special token, "
                "or use `bpe:<vocab_size>` which adds one"
            )
        return cls("hf", str(path), tok, max(vocab.values()) + 1, eos_id)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.kind == "tiktoken":
            return [self._backend.encode_ordinary(t) for t in texts]
        # encode_batch_fast: the same ids as encode_batch without the character offsets,
        # which nothing here reads, so it skips computing them.
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)


def _tiktoken_offline_message(err: BaseException) -> str:
    names = ", ".join(
        f"{url.rsplit('/', 1)[1]} as {hashlib.sha1(url.encode()).hexdigest()}"
        for url in _GPT2_FILES
    )
    detail = f"{type(err).__name__}: {err}"[:300]
    return (
        f"could not load tiktoken's `gpt2` encoding ({detail}). tiktoken downloads it on first "
        "use and this machine cannot. Provide the encoding files: on a machine with network "
        'access run `TIKTOKEN_CACHE_DIR=<dir> python -c "import tiktoken; '
        "tiktoken.get_encoding('gpt2')\"`, copy <dir> here and set TIKTOKEN_CACHE_DIR=<dir> "
        f"(the folder must hold {names}, downloaded from {' and '.join(_GPT2_FILES)}). "
        "Or pick an offline tokenizer: --tokenizer path/to/tokenizer.json or "
        "--tokenizer bpe:<vocab_size>"
    )


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    path: Path,
    merging: contextlib.AbstractContextManager | None = None,
) -> None:
    """Train a byte-level BPE with `<|endoftext|>` (id 0) as EOS; save it as tokenizer.json.
    The trainer reads every text, then computes the merges, a long step that reports nothing:
    `merging` (e.g. Progress.waiting) is entered once the texts are read and left when the
    merges are done."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    after = contextlib.ExitStack()

    def read() -> Iterator[str]:
        yield from texts
        if merging is not None:
            after.enter_context(merging)

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with after:
        tok.train_from_iterator(read(), trainer=trainer)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)


def parse_bpe_spec(spec: str) -> int:
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        n = -1
    if n < 257:
        raise DataError(
            f"bad tokenizer spec {spec!r}: bpe:<vocab_size> needs an integer vocab_size ≥ 257 "
            "(256 bytes plus EOS), e.g. bpe:8192"
        )
    return n


def load_tokenizer(split_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared split was made with (e.g. to decode samples)."""
    split_dir = Path(split_dir)
    spec = load_manifest(split_dir)["tokenizer"]
    kind, source = spec.get("kind"), spec.get("path") or spec.get("name")
    if kind == "hf":
        source = str((split_dir / source).resolve())
    return Tokenizer.load(kind, source)
