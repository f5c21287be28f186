"""Runs a Llama-family model's dense layers on the paddle inference predictor (oneDNN).

The three programs of ``dense_graph`` are exported once per model shape and code version into a
cache directory (``$KETCH_CACHE_DIR``, default ``~/.cache/ketch``), keyed by a hash of both, and
loaded into one predictor each. A step alternates predictor calls with attention over the paged
KV cache in dygraph, which writes the new keys/values into the cache tensors in place (they are
``from_dlpack`` views of the shared-memory buffer), so nothing is copied per step but the small
per-token activations. Weights are passed as inputs that alias the loaded tensors.

Why the cut at attention (measured, see docs/backend.md): a predictor program can write the KV
cache in place, but only through the value returned by ``index_put_``; the attention of a mixed
batch needs a variable number of groups, which one static program cannot express without padding
every group to the longest. The dense layers are ~95% of the FLOPs and run 2-3x faster here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import paddle

from ketch.kernels import dense_graph
from ketch.kernels.dense_graph import DenseShape

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "KETCH_CACHE_DIR"
_KINDS = ("first", "middle", "last")


def cache_root() -> Path:
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "ketch")


def program_key(shape: DenseShape) -> str:
    """Hash of the model shape, the graph code and the paddle build that exports it."""
    digest = hashlib.sha256()
    digest.update(json.dumps(shape.as_dict(), sort_keys=True).encode())
    digest.update(Path(dense_graph.__file__).read_bytes())
    digest.update(f"{paddle.__version__} {paddle.version.commit}".encode())
    return digest.hexdigest()[:24]


def export_programs(shape: DenseShape, root: Path | None = None) -> Path:
    """The directory holding the three exported programs, exporting them on first use.

    The export goes to a temporary directory renamed into place, so concurrent workers never
    read a half-written program (the loser of a race discards its copy)."""
    target = (root or cache_root()) / "programs" / program_key(shape)
    if (target / "done").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".export-", dir=target.parent))
    try:
        for kind in _KINDS:
            fn = dense_graph.PROGRAMS[kind](shape)
            static = paddle.jit.to_static(
                fn, input_spec=dense_graph.input_specs(shape, kind), full_graph=True
            )
            with warnings.catch_warnings():  # "no variable in your model": weights are inputs
                warnings.simplefilter("ignore", UserWarning)
                paddle.jit.save(static, str(scratch / kind))
        (scratch / "shape.json").write_text(json.dumps(shape.as_dict(), indent=1))
        (scratch / "done").write_text("")
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "done").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("exported the dense programs to %s", target)
    return target


def create_predictor(directory: Path, kind: str, threads: int) -> paddle.inference.Predictor:
    """A predictor for program ``kind`` of ``directory``: oneDNN, ``threads`` math threads."""
    from paddle import inference

    model = directory / f"{kind}.json"
    params = directory / f"{kind}.pdiparams"
    config = inference.Config(str(model), str(params) if params.is_file() else "")
    config.disable_gpu()
    config.enable_onednn()
    config.set_cpu_math_library_num_threads(threads)
    config.disable_glog_info()
    # This pass turns matmul + bias into an fc op whose oneDNN kernel keeps the weights it saw
    # first, as if they were parameters: the one middle program, fed each layer's weights,
    # then reuses layer 1's (measured: logits off by 50% with biases and >= 3 layers).
    config.delete_pass("matmul_add_act_fuse_pass")
    return inference.create_predictor(config)


class DensePrograms:
    """The three loaded predictors, called with paddle tensors (no host copies)."""

    def __init__(self, shape: DenseShape, threads: int, root: Path | None = None) -> None:
        directory = export_programs(shape, root)
        self.directory = directory
        self._predictors = {kind: create_predictor(directory, kind, threads) for kind in _KINDS}

    def run(self, kind: str, inputs: list[paddle.Tensor]) -> list[paddle.Tensor]:
        """Inputs in ``dense_graph.input_specs`` order, weights flattened after the tokens'."""
        return self._predictors[kind].run(inputs)
