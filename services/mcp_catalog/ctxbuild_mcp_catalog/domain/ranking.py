"""tool_search's ranking: lexical (BM25) fused with semantic (sentence embeddings) by relative score fusion.

- Lexical: bm25s (Lucene variant) over a tool's name, namespace, description, parameter names and parameter
  descriptions. Words are split on snake/kebab case and lowerCamelCase; a Capitalised compound ("GitHub",
  "MongoDB", "JavaScript") stays one word, so "git" does not find every GitHub tool.
- Semantic: cosine between the query's vector and each tool's vector, from an ``Embed`` function
  (adapters/embedder.py). A tool's vector is the mean of the unit vectors of three views of it
  (``semantic_views``): namespace, name and description; the same with its parameter names (what it takes);
  namespace, name and only the description's first sentence (what it does, before the details that dilute a long
  description). A request phrased after any one of them comes near. Cosines are rounded to 1e-4 before ranking,
  so a last-bit difference between two CPUs' float kernels cannot reorder tools across replicas.
- Fusion: relative score fusion (each ranker's scores min-max normalised over the catalog, then a weighted sum:
  (1 − α)·cosine + α·BM25, α = ``LEXICAL_WEIGHT``). Scores, not ranks: a tool the model is sure of keeps its lead,
  where reciprocal rank fusion (``rrf``, kept for the bench's comparison) flattens it. Ties break on the tools'
  order, so the output is the same on every replica.
- Requests are expanded with the long form of a few common abbreviations ("PR" → pull request, "db" → database,
  …) before both rankers: tool descriptions spell them out, and the model does not know them either.

Pure: the vectors are given (the catalog caches them); only the query is embedded here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import bm25s
import numpy as np

from .schemas import walk

Embed = Callable[[Sequence[str]], np.ndarray]  # texts → unit-length rows

LEXICAL_WEIGHT = 0.25  # requests are mostly paraphrases: meaning leads, shared words (names, identifiers) lift
RRF_K = 60  # reciprocal rank fusion's usual constant (the bench's comparison)
SEMANTIC_FLOOR = 0.15  # below this cosine a tool is unrelated to the request: not returned on meaning alone
SEMANTIC_DESCRIPTION_CHARS = 400
SEMANTIC_FIRST_SENTENCE_CHARS = 200  # a description without a sentence end: its start stands for the first sentence
SEMANTIC_VIEWS = 3
PARAM_DESCRIPTION_CHARS = 160

_WORD = re.compile(r"[A-Za-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_STOP = {"a", "an", "the", "of", "to", "in", "on", "for", "and", "or", "is", "be", "by", "with", "this", "that",
         "it", "as", "at", "from", "if", "its", "are", "mcp"}


def _stem(tok: str) -> str:
    if len(tok) > 4 and tok.endswith("ies"):
        return tok[:-3] + "y"
    if len(tok) > 3 and tok.endswith("s") and not tok.endswith(("ss", "us", "is")):
        return tok[:-1]
    return tok


# common abbreviations in requests whose long form is what tool descriptions say
ABBREVIATIONS = {
    "pr": "pull request", "prs": "pull requests", "repo": "repository", "repos": "repositories",
    "db": "database", "dbs": "databases", "dir": "directory", "dirs": "directories", "env": "environment",
    "config": "configuration", "ls": "list", "mkdir": "make directory", "rm": "remove", "cwd": "current directory",
    "tz": "timezone", "img": "image", "msg": "message", "info": "information", "auth": "authentication",
}


def expand_query(query: str) -> str:
    """The request with the long form of its abbreviations appended, e.g. "merge PR 12 (pull request)"."""
    longs = list(dict.fromkeys(ABBREVIATIONS[w] for w in (x.lower() for x in _WORD.findall(query or ""))
                               if w in ABBREVIATIONS))
    return f"{query} ({', '.join(longs)})" if longs else query


def words(text: str) -> list[str]:
    """Lower-case words: snake_case, kebab-case and lowerCamelCase split; a Capitalised compound kept whole."""
    out: list[str] = []
    for raw in _WORD.findall(text or ""):
        parts = [raw] if raw[0].isupper() else _CAMEL.split(raw)
        out.extend(p.lower() for p in parts if p)
    return out


def tokenize(text: str) -> list[str]:
    """BM25 tokens: ``words`` with a light plural stem and stop words out."""
    return [_stem(w) for w in words(text) if w not in _STOP]


def parameters(schema: Any) -> list[tuple[str, str]]:
    """(name, description) of every property anywhere in the schema."""
    out: list[tuple[str, str]] = []
    for _, node in walk(schema if isinstance(schema, dict) else {}):
        props = node.get("properties")
        if isinstance(props, dict):
            for key, sub in props.items():
                desc = sub.get("description") if isinstance(sub, dict) else None
                out.append((key, desc if isinstance(desc, str) else ""))
    return out


def lexical_document(tool: Mapping[str, Any]) -> list[str]:
    """The tokens a tool is found by: name (twice: a word of the name is worth more than one in the prose),
    namespace, description, parameter names and their descriptions (cut, so a long schema cannot swamp)."""
    name = tokenize(tool["name"])
    params = parameters(tool.get("inputSchema"))
    return [*name, *name, *tokenize(tool.get("namespace", "")), *tokenize(tool.get("description", "")),
            *[t for p, _ in params for t in tokenize(p)],
            *[t for _, d in params for t in tokenize(d[:PARAM_DESCRIPTION_CHARS])]]


def semantic_text(tool: Mapping[str, Any]) -> str:
    """What a tool's vector is computed from: namespace and name as words, then the start of its description."""
    desc = " ".join((tool.get("description") or "").split())[:SEMANTIC_DESCRIPTION_CHARS]
    return f"{_heading(tool)} {desc}".strip()


def _heading(tool: Mapping[str, Any]) -> str:
    """Namespace and name as words, ending the sentence the description continues."""
    return f"{' '.join(words(tool.get('namespace', '')))} {' '.join(words(tool['name']))}."


def _first_sentence(description: str) -> str:
    end = description.find(". ")
    return description[:end + 1] if end > 0 else description[:SEMANTIC_FIRST_SENTENCE_CHARS]


def semantic_views(tool: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``SEMANTIC_VIEWS`` texts whose vectors' mean is the tool's vector (a tool without parameters, or with
    a one-sentence description, repeats a view: the mean is then weighted towards it)."""
    base = semantic_text(tool)
    names = ", ".join(dict.fromkeys(" ".join(words(p)) for p, _ in parameters(tool.get("inputSchema"))))
    desc = " ".join((tool.get("description") or "").split())
    return (base, f"{base} Parameters: {names}." if names else base,
            f"{_heading(tool)} {_first_sentence(desc[:SEMANTIC_FIRST_SENTENCE_CHARS * 5])}".strip())


def semantic_texts(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every tool's ``semantic_views``, in order: embed them, then ``pool_views`` the rows."""
    return [text for t in tools for text in semantic_views(t)]


def pool_views(rows: np.ndarray) -> np.ndarray:
    """One vector per tool, the mean of its views' rows (as ``semantic_texts`` laid them out). Not re-normalised:
    the query's dot product with it is the mean of its cosines with the views."""
    rows = np.asarray(rows, dtype=np.float32)
    return rows.reshape(-1, SEMANTIC_VIEWS, rows.shape[-1]).mean(axis=1)


def rrf(rankings: Sequence[tuple[Sequence[int], float]], k: int = RRF_K) -> list[tuple[int, float]]:
    """Weighted reciprocal rank fusion of rankings (lists of item indexes, best first) → (index, score), best
    first; equal scores keep the lower index first."""
    scores: dict[int, float] = {}
    for ranking, weight in rankings:
        for rank, i in enumerate(ranking, start=1):
            scores[i] = scores.get(i, 0.0) + weight / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-round(kv[1], 12), kv[0]))


def _min_max(x: np.ndarray) -> np.ndarray:
    lo, hi = float(x.min()), float(x.max())
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def relative_score_fusion(lexical: np.ndarray, semantic: np.ndarray, alpha: float = LEXICAL_WEIGHT) -> np.ndarray:
    """(1 − alpha)·minmax(semantic) + alpha·minmax(lexical), one score per tool, rounded to 1e-6."""
    return np.round((1.0 - alpha) * _min_max(semantic) + alpha * _min_max(lexical), 6)


class SearchIndex:
    """The deferred tools of one catalog, searchable. With ``vectors`` (one row per tool, ``pool_views``) and
    ``embed`` the ranking is hybrid; without, lexical only."""

    def __init__(self, tools: Sequence[Mapping[str, Any]], vectors: np.ndarray | None = None,
                 embed: Embed | None = None, *, lexical_weight: float = LEXICAL_WEIGHT) -> None:
        self.tools = list(tools)
        self.vectors = vectors if vectors is not None and len(vectors) == len(self.tools) else None
        self.embed = embed if self.vectors is not None else None
        self.alpha = lexical_weight
        self._bm25: bm25s.BM25 | None = None
        if self.tools:
            self._bm25 = bm25s.BM25()
            self._bm25.index([lexical_document(t) or [""] for t in self.tools], show_progress=False)

    @property
    def hybrid(self) -> bool:
        return self.embed is not None

    def lexical(self, query: str) -> list[tuple[int, float]]:
        """(tool index, BM25 score) of the tools sharing a word with the query, best first."""
        tokens = tokenize(expand_query(query))
        if self._bm25 is None or not tokens:
            return []
        scores = self._bm25.get_scores(tokens)
        ranked = sorted(range(len(self.tools)), key=lambda i: (-round(float(scores[i]), 6), i))
        return [(i, float(scores[i])) for i in ranked if scores[i] > 0]

    def cosines(self, query: str) -> np.ndarray | None:
        """The query's cosine with every tool, rounded to 1e-4; None when not hybrid or the query is blank."""
        if self.embed is None or self.vectors is None or not query.strip() or not self.tools:
            return None
        q = np.asarray(self.embed([expand_query(query)]), dtype=np.float32)[0]
        return np.round(self.vectors @ q, 4).astype(np.float64)

    def semantic(self, query: str) -> list[tuple[int, float]]:
        """(tool index, cosine) of the tools at or above the floor, best first."""
        cos = self.cosines(query)
        if cos is None:
            return []
        ranked = sorted(range(len(self.tools)), key=lambda i: (-float(cos[i]), i))
        return [(i, float(cos[i])) for i in ranked if cos[i] >= SEMANTIC_FLOOR]

    def ranked(self, query: str) -> list[tuple[int, float]]:
        """(tool index, score) best first: the fusion when hybrid, else BM25. A tool is returned when it shares
        a word with the request or its cosine reaches the floor."""
        lexical = self.lexical(query)
        cos = self.cosines(query) if self.hybrid else None
        if cos is None:
            return lexical
        lex = np.zeros(len(self.tools))
        for i, s in lexical:
            lex[i] = s
        fused = relative_score_fusion(lex, cos, self.alpha)
        keep = [i for i in range(len(self.tools)) if lex[i] > 0 or cos[i] >= SEMANTIC_FLOOR]
        return [(i, float(fused[i])) for i in sorted(keep, key=lambda i: (-float(fused[i]), i))]

    def search(self, query: str, limit: int = 5) -> list[tuple[Mapping[str, Any], float]]:
        return [(self.tools[i], round(s, 4)) for i, s in self.ranked(query)[:limit]]
