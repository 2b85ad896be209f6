"""m3run: a supervised, crash-proof pretraining runner for the Mamba-3-Lite language model.

Everything imports under this one namespace: ``m3run.runner`` (the supervisor, the worker and
the CLI), ``m3run.model`` (Mamba-3-Lite) and ``m3run.kernels`` (the scan and the block
kernels), so that no package with a generic name (``model``, ``kernels``, ``runner``) is
installed at the top level, where it would shadow, or be shadowed by, a user's own module or
another distribution's (Hugging Face's ``kernels``).

The repository keeps those three packages as its top-level folders: an installed m3run
(``pip install .``) has them inside this package (pyproject.toml's ``package-dir``), and in a
source tree (a checkout on PYTHONPATH, or an editable install) they are found beside this
folder, which is added to the package's path below.
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "runner").is_dir() and (_checkout / "runner").is_dir():
    __path__.append(str(_checkout))
