"""A prepared split's tokenizer as one HF tokenizer.json (what a run dir keeps and an export
ships): a HF tokenizer copied as it is, tiktoken's byte-level BPE converted to the same ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tiktoken
from tiktoken._educational import bpe_train
from tiktoken_ext.openai_public import r50k_pat_str
from tokenizers import Tokenizer as HFTokenizer

from m3run.runner.data.manifest import DataError
from m3run.runner.data.tokenizer import EOS_TEXT, Tokenizer
from m3run.runner.data.tokenizer_file import tiktoken_to_hf_json, tokenizer_json_text

# Text that exercises GPT-2's pre-tokenizer: contractions, runs of spaces and newlines, digits,
# accents, CJK, an emoji (4 UTF-8 bytes), trailing whitespace and a literal special token.
TEXTS = [
    "Hello  world!\n\n  It's the cat's toy, isn't it?  They'll've gone.\t\n",
    "x = 1234567 + 89; café naïve 中文字 🙂🙂 end   ",
    f"{EOS_TEXT} is text here, not a separator  \n\n\n",
    "def f(a, b):\n    return a**2 + b  # comment\n",
]


def _same_ids(hf_json: str, encode, texts=TEXTS) -> None:
    hf = HFTokenizer.from_str(hf_json)
    hf.encode_special_tokens = True  # as m3run loads it: a special token's text is text
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ids == encode(text), text
        assert hf.decode(ids, skip_special_tokens=False) == text


def test_a_tiktoken_bpe_converts_to_a_hf_tokenizer_with_the_same_ids():
    # A small byte-level BPE trained here with GPT-2's pattern: the real gpt2 files need a
    # download, and the conversion reads nothing but the Encoding's tokens.
    training = "".join(TEXTS[:2]) * 3 + Path(tiktoken.__file__).read_text()[:6000]
    ranks = bpe_train(training, 300, r50k_pat_str, visualise=None)
    enc = tiktoken.Encoding(
        "small-gpt2-like",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOS_TEXT: len(ranks)},
    )
    converted = tiktoken_to_hf_json(enc)
    _same_ids(converted, enc.encode_ordinary, [*TEXTS, training])
    added = json.loads(converted)["added_tokens"]
    assert [(a["content"], a["id"], a["special"]) for a in added] == [(EOS_TEXT, len(ranks), True)]


def _gpt2_loadable() -> bool:
    try:
        tiktoken.get_encoding("gpt2")
    except Exception:
        return False
    return True


def test_a_gpt2_split_gives_gpt2_as_a_tokenizer_json_or_the_offline_message(corpus, tmp_path):
    split = tmp_path / "data" / "train"
    shutil.copytree(corpus / "train", split)
    manifest = json.loads((split / "manifest.json").read_text())
    manifest["tokenizer"] = {"spec": "gpt2", "kind": "tiktoken", "name": "gpt2"}
    (split / "manifest.json").write_text(json.dumps(manifest))
    if not _gpt2_loadable():
        with pytest.raises(DataError, match="TIKTOKEN_CACHE_DIR"):
            tokenizer_json_text(split)
        return
    text = tokenizer_json_text(split)
    gpt2 = tiktoken.get_encoding("gpt2")
    _same_ids(text, gpt2.encode_ordinary)
    (tmp_path / "tokenizer.json").write_text(text)
    assert Tokenizer.load("hf", str(tmp_path / "tokenizer.json")).eos_id == gpt2.eot_token


def test_a_hf_split_gives_its_tokenizer_file_unless_it_changed(corpus, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    original = (corpus / "tokenizer.json").read_text()
    assert tokenizer_json_text(data / "train") == original
    (data / "tokenizer.json").write_text(original.replace('"<|endoftext|>"', '"<|eot|>"'))
    with pytest.raises(DataError, match=r"changed since the data .* was prepared"):
        tokenizer_json_text(data / "train")
    (data / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"is gone: .*tokenizer.json is not a file"):
        tokenizer_json_text(data / "train")
