"""A prepared split's tokenizer as one Hugging Face `tokenizer.json`: the file a run dir keeps so
that `generate` and `export` need nothing outside it, and the one an export ships.

A HF tokenizer (a tokenizer.json given to prepare-data, or the `bpe:N` one it trained beside the
splits) is copied byte for byte. tiktoken's `gpt2` encoding is converted: the same byte-level
BPE (GPT-2's pre-tokenizer, its vocabulary and merges, `<|endoftext|>` at its id) written in the
`tokenizers` format, which encodes every text to the ids tiktoken gives. Torch-free.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from m3run.runner.data.manifest import DataError, load_manifest
from m3run.runner.data.tokenizer import Tokenizer
from m3run.runner.files import atomic_write_text, sha256_file

__all__ = ["tiktoken_to_hf_json", "tokenizer_json_text"]


def tokenizer_json_text(split_dir: str | Path) -> str:
    """The tokenizer `split_dir` was prepared with, as the text of a HF tokenizer.json.
    DataError when the split's manifest, or the tokenizer it names, cannot be read, or when a
    tokenizer.json changed since the data was prepared (its sha256 is in the manifest)."""
    split_dir = Path(split_dir)
    spec = load_manifest(split_dir)["tokenizer"]
    kind = spec.get("kind")
    if kind == "tiktoken":
        name = spec.get("name")
        Tokenizer.load("tiktoken", name)  # the offline message when tiktoken cannot load it
        import tiktoken

        return tiktoken_to_hf_json(tiktoken.get_encoding(name))
    if kind != "hf":
        raise DataError(f"the manifest in {split_dir} names a tokenizer of unknown kind {kind!r}")
    source = (split_dir / spec.get("path", "")).resolve()
    if not source.is_file():
        raise DataError(
            f"the tokenizer the data in {split_dir} was prepared with is gone: {source} "
            "is not a file; put it back, or prepare the data again"
        )
    expected = spec.get("sha256")
    if expected and sha256_file(source) != expected:
        raise DataError(
            f"{source} changed since the data in {split_dir} was prepared (its sha256 is not "
            "the manifest's): the data's token ids belong to the old file; put that back, or "
            "prepare the data again"
        )
    try:
        return source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read the tokenizer {source}: {e}") from None


def write_tokenizer_file(split_dir: str | Path, dest: str | Path) -> None:
    """Write `tokenizer_json_text(split_dir)` to `dest` atomically (DataError, OSError)."""
    atomic_write_text(dest, tokenizer_json_text(split_dir))


@cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet of a byte-level BPE's vocabulary
    (`bytes_to_unicode` in GPT-2's encoder.py; the `tokenizers` ByteLevel pre-tokenizer's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiktoken_to_hf_json(encoding: Any) -> str:
    """A tiktoken Encoding with GPT-2's pre-tokenizer pattern (`gpt2`, the one m3run takes) as
    the text of a HF tokenizer.json that encodes every text to the same ids.

    tiktoken keeps ranks, not merges: it joins the adjacent pair whose join has the lowest
    rank. Every split of a token into two tokens is therefore a merge, ordered by the rank of
    the token it makes (as `transformers` converts tiktoken files)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    chars = _byte_chars()
    specials = {s: encoding.encode_single_token(s) for s in encoding.special_tokens_set}
    ranks: dict[bytes, int] = {}
    for i in range(encoding.n_vocab):
        if i not in specials.values():
            ranks[encoding.decode_single_token_bytes(i)] = i

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    vocab = {text(t): r for t, r in ranks.items()}
    vocab.update(specials)
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], fuse_unk=False)
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in sorted(specials, key=specials.get)]
    )
    return tok.to_str()
