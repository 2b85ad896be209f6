"""A trained model out of a run dir: sampling text from a checkpoint (`m3run generate`) and an
export folder (`m3run export`) that Hugging Face `transformers` and m3run both load.

An export is a directory of
- `model.safetensors`: the weights under m3run's parameter names, with the run's step, config
  hash and m3run version as metadata (`Mamba3LM.from_export(dir)` loads it back);
- `config.json`: Hugging Face's fields (`model_type`, `architectures`, `auto_map`, the sizes and
  token ids) and m3run's ModelConfig under `model`, numbers as numbers;
- `configuration_m3run.py` and `modeling_m3run.py` (copied from runner/hf): with them,
  `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads the model (they
  import m3run, which holds the model);
- `tokenizer.json` and `tokenizer_config.json` (`AutoTokenizer.from_pretrained(dir,
  trust_remote_code=True)`: it reads config.json too; the end-of-text token is its eos token);
- the marker file `EXPORT_MARKER` (the run and step exported). Only the marker makes a
  directory an export that a later export may replace: a `config.json` alone does not, since a
  Hugging Face model folder has one too.
Torch is imported here; the CLI imports this module only after the arguments are checked.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from m3run.model import Mamba3LM
from m3run.runner import __version__
from m3run.runner.checkpoint.io import load_checkpoint
from m3run.runner.data.tokenizer import Tokenizer
from m3run.runner.data.tokenizer_file import tiktoken_to_hf_json
from m3run.runner.files import apply_umask, atomic_write_text
from m3run.runner.trained import EXPORT_MARKER, ExportError, TrainedRun, check_export_dir

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
EXPORT_TOKENIZER = "tokenizer.json"
EXPORT_TOKENIZER_CONFIG = "tokenizer_config.json"
# The Hugging Face classes an export ships, as runner/hf holds them.
HF_CODE_DIR = Path(__file__).resolve().parent / "hf"
HF_CONFIG_FILE, HF_MODELING_FILE = "configuration_m3run.py", "modeling_m3run.py"
HF_MODEL_TYPE = "m3run_mamba3"
HF_AUTO_MAP = {
    "AutoConfig": "configuration_m3run.M3RunConfig",
    "AutoModelForCausalLM": "modeling_m3run.M3RunForCausalLM",
}


def load_model(trained: TrainedRun) -> Mamba3LM:
    """The run's model at the found checkpoint, on CPU, in eval mode."""
    model = Mamba3LM(trained.config.model)
    model.load_state_dict(load_checkpoint(trained.checkpoint.path, hashes_checked=True)[0])
    return model.eval()


# ------------------------------------------------------------------------------- generate


class TextStream:
    """Decoded text of tokens that arrive one at a time, each piece given once it is whole.

    A byte-level BPE token can end inside a UTF-8 character, so a piece is held back while it
    decodes to a replacement character. Only the tokens since the last whole piece are decoded
    again (as text-generation-inference streams), so a long stream costs no more per token."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # decoding starts here: the context of the pending tokens
        self.read = 0  # tokens up to here have been given as text

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._take(final=False)

    def flush(self) -> str:
        """What is left at the end, whole or not."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


def stream_text(
    trained: TrainedRun,
    model: Mamba3LM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
) -> Iterator[str]:
    """The prompt's continuation as text, piece by piece as the tokens are sampled; it ends at
    the end-of-text token (not shown) or after `max_new_tokens`."""
    torch.manual_seed(seed)
    eos = trained.tokenizer.eos_id
    text = TextStream(trained.tokenizer)
    steps = model.stream(
        torch.tensor([prompt_ids]), max_new_tokens, temperature, top_k, top_p, eos_id=eos
    )
    for token in steps:
        token_id = int(token[0])
        if token_id == eos:
            break
        if piece := text.push(token_id):
            yield piece
    if rest := text.flush():
        yield rest


# ------------------------------------------------------------------------------- export


def export(trained: TrainedRun, out: Path) -> Path:
    """Write the export directory `out`: created when missing, refused when it holds anything
    but an earlier export (which is replaced)."""
    out = Path(out)
    check_export_dir(out)
    model = load_model(trained)
    try:
        _write(trained, model, out)
    except OSError as e:
        raise ExportError(
            f"cannot write the export to {out}: {e.strerror or e}; pass a directory you can write"
        ) from None
    return out


def _write(trained: TrainedRun, model: Mamba3LM, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    step = trained.checkpoint.step
    # The marker goes first: an export killed half-way is still ours to replace on the retry.
    marker = {"run": str(trained.run_dir.resolve()), "step": step}
    _write_json(out / EXPORT_MARKER, marker)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    # safetensors metadata is text only; "format": "pt" is what transformers checks for.
    meta = {
        "format": "pt",
        "step": str(step),
        "config_hash": trained.config_hash,
        "m3run_version": __version__,
    }
    save_file(state, out / EXPORT_WEIGHTS, metadata=meta)
    apply_umask(out / EXPORT_WEIGHTS)
    for name in (HF_CONFIG_FILE, HF_MODELING_FILE):
        shutil.copyfile(HF_CODE_DIR / name, out / name)
        apply_umask(out / name)
    tok = trained.tokenizer
    eos_token = tok.decode([tok.eos_id])
    _write_tokenizer(tok, out / EXPORT_TOKENIZER)
    _write_json(
        out / EXPORT_TOKENIZER_CONFIG,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos_token,
            # The training window: the model reads past it, but it was never trained to.
            "model_max_length": trained.context,
            "clean_up_tokenization_spaces": False,
        },
    )
    cfg = model.config
    _write_json(
        out / EXPORT_CONFIG,
        {
            "model_type": HF_MODEL_TYPE,
            "architectures": ["M3RunForCausalLM"],
            "auto_map": HF_AUTO_MAP,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers,
            "eos_token_id": tok.eos_id,
            # No padding token of its own: generate pads (never reads) with the eos id.
            "pad_token_id": tok.eos_id,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "model": cfg.model_dump(mode="json"),
            "tokenizer": {"kind": "hf", "source": EXPORT_TOKENIZER, "eos_token": eos_token},
            "step": step,
            "config_hash": trained.config_hash,
            "m3run_version": __version__,
        },
    )


def _write_tokenizer(tok: Tokenizer, dest: Path) -> None:
    """The run's tokenizer as a HF tokenizer.json: a copy, or tiktoken's gpt2 converted."""
    if tok.kind == "hf":
        shutil.copyfile(tok.source, dest)
        apply_umask(dest)
    else:
        import tiktoken

        atomic_write_text(dest, tiktoken_to_hf_json(tiktoken.get_encoding(tok.source)))


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n", fsync=False)
