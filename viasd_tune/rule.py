"""Per-request routing rule of a routed profile: the prompt features it reads, the plain-JSON decision tree that
maps them to one of the profile's configurations, applying it, and fitting it with scikit-learn.

The tree is data, never code: ``{"nodes": [...]}`` where node 0 is the root and each node is either a split
``{"feature": F, "threshold": T, "left": i, "right": j}`` (numeric F: right when value > T, else left),
``{"feature": "category", "in": [...], "left": i, "right": j}`` (right when the caller's category is listed;
no category goes left) or a leaf ``{"config": k}`` naming configuration k. Children always have larger indices
than their parent, so a valid tree has no cycle and a walk ends in at most ``MAX_DEPTH`` steps.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import UserError
from .prompts import task_group

# Numeric features, in the order the fitted classifier sees them (category one-hots follow).
NUMERIC_FEATURES = ("prompt_tokens", "copy_share")
FEATURES = (*NUMERIC_FEATURES, "category")
COPY_NGRAM = 3  # prompt lookup matches up to 3-grams (decoding.drafters.LookupDrafter)
MAX_DEPTH = 6  # a readable rule; the search fits depth 2
MAX_NODES = 2 ** (MAX_DEPTH + 1) - 1


def prompt_features(ids: Sequence[int] | np.ndarray | Any, category: str | None = None) -> dict[str, Any]:
    """What the rule may read about a prompt before decoding: its length in tokens, its lookup copy potential
    and the caller's category (``None``: not given) as its task group: MT-bench's eight categories count as one,
    ``conversation``, as Spec-Bench reports them (a few prompts each are too few to route on; other categories
    are their own group).

    ``copy_share`` is the share of the prompt's 3-grams that already occurred earlier in the prompt: text that
    repeats itself (code, documents with recurring names) is what prompt lookup can copy from. One ``np.unique``
    over the n-grams; no model call."""
    a = np.asarray(ids.tolist() if hasattr(ids, "tolist") else list(ids), dtype=np.int64).reshape(-1)
    n = a.size - COPY_NGRAM + 1
    share = 0.0
    if n > 0:
        grams = np.lib.stride_tricks.sliding_window_view(a, COPY_NGRAM)
        share = 1.0 - np.unique(grams, axis=0).shape[0] / n
    if category is not None and not isinstance(category, str):
        raise UserError(
            f"category must be text such as 'qa' (got {type(category).__name__} {category!r}), or None"
        )
    group = None if category is None else task_group(category)
    return {"prompt_tokens": int(a.size), "copy_share": float(share), "category": group}


# ------------------------------------------------------------------------------------------------ the tree


def _bad(problem: str) -> UserError:
    return UserError(f"invalid routing rule: {problem}; fix routes.rule in the profile or re-export it")


def _index(node: dict, key: str, i: int, n_nodes: int) -> int:
    j = node.get(key)
    if isinstance(j, bool) or not isinstance(j, int) or not i < j < n_nodes:
        raise _bad(f"nodes[{i}].{key} is {j!r}; it must index a later node (after {i}, below {n_nodes})")
    return j


def validate_rule(rule: Any, n_configs: int) -> dict[str, Any]:
    """Check a rule's structure against ``n_configs`` configurations; return it unchanged if valid."""
    if not isinstance(rule, dict) or not isinstance(rule.get("nodes"), list) or not rule["nodes"]:
        raise _bad('it must be an object {"nodes": [...]} with at least one node')
    nodes = rule["nodes"]
    if len(nodes) > MAX_NODES:
        raise _bad(f"{len(nodes)} nodes; at most {MAX_NODES} (depth {MAX_DEPTH})")
    depth = [0] * len(nodes)
    reached = [False] * len(nodes)
    reached[0] = True
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            raise _bad(f"nodes[{i}] is not an object")
        if not reached[i]:
            raise _bad(f"nodes[{i}] is not reachable from the root (nodes[0])")
        if "config" in node:
            k = node["config"]
            if set(node) != {"config"}:
                raise _bad(f"nodes[{i}] is a leaf and may only hold 'config'")
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n_configs:
                raise _bad(
                    f"nodes[{i}].config is {k!r}; there are {n_configs} configurations (0..{n_configs - 1})"
                )
            continue
        feature = node.get("feature")
        if feature not in FEATURES:
            raise _bad(f"nodes[{i}].feature is {feature!r}; use one of {', '.join(FEATURES)}")
        if feature == "category":
            cats = node.get("in")
            if set(node) != {"feature", "in", "left", "right"} or not (
                isinstance(cats, list) and cats and all(isinstance(c, str) for c in cats)
            ):
                raise _bad(f'nodes[{i}] splits on category: it needs "in" (a list of names), "left", "right"')
            # The rule reads the task group (prompt_features), so a raw MT-bench name could never match.
            raw = next((c for c in cats if task_group(c) != c), None)
            if raw is not None:
                raise _bad(
                    f"nodes[{i}].in lists {raw!r}, a raw MT-bench category; a rule reads task groups, where "
                    f"{raw!r} is {task_group(raw)!r}: list that instead"
                )
        else:
            t = node.get("threshold")
            if set(node) != {"feature", "threshold", "left", "right"} or (
                isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t)
            ):
                raise _bad(f'nodes[{i}] splits on {feature}: it needs a finite "threshold", "left", "right"')
        for key in ("left", "right"):
            j = _index(node, key, i, len(nodes))
            if reached[j]:
                raise _bad(f"nodes[{j}] has two parents; a tree node has one")
            reached[j], depth[j] = True, depth[i] + 1
            if depth[j] > MAX_DEPTH:
                raise _bad(f"it is deeper than {MAX_DEPTH} levels; a routing rule stays small and readable")
    return rule


def one_leaf(config: int = 0) -> dict[str, Any]:
    """The rule that always picks ``config``."""
    return {"nodes": [{"config": config}]}


def apply_rule(rule: dict[str, Any], features: dict[str, Any]) -> int:
    """The configuration index the (validated) rule picks for a prompt with these features."""
    nodes = rule["nodes"]
    node = nodes[0]
    while "config" not in node:
        f = node["feature"]
        right = features.get(f) in node["in"] if f == "category" else features[f] > node["threshold"]
        node = nodes[node["right" if right else "left"]]
    return node["config"]


def leaves(rule: dict[str, Any]) -> list[int]:
    """The configurations a rule can pick, in node order."""
    return [n["config"] for n in rule["nodes"] if "config" in n]


# ------------------------------------------------------------------------------------------------ fitting


def _matrix(rows: list[dict[str, Any]], categories: list[str]) -> np.ndarray:
    return np.array(
        [
            [r[f] for f in NUMERIC_FEATURES] + [float(r.get("category") == c) for c in categories]
            for r in rows
        ],
        dtype=np.float64,
    )


def fit_rule(
    rows: list[dict[str, Any]],
    labels: Sequence[int],
    max_depth: int = 2,
    weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """A decision tree (scikit-learn's ``DecisionTreeClassifier``) from prompt features to the configuration
    index that served each prompt best, converted from sklearn's ``tree_`` arrays into the JSON form.
    ``weights``: per-prompt sample weights (e.g. how much time the right choice saves)."""
    from sklearn.tree import DecisionTreeClassifier

    if not 1 <= max_depth <= MAX_DEPTH:
        raise UserError(f"the rule's depth must be from 1 to {MAX_DEPTH} (got {max_depth})")
    labels = [int(x) for x in labels]
    if len(set(labels)) < 2:
        return one_leaf(labels[0] if labels else 0)
    categories = sorted({r["category"] for r in rows if r.get("category") is not None})
    names = [*NUMERIC_FEATURES, *(f"category={c}" for c in categories)]
    clf = DecisionTreeClassifier(max_depth=max_depth, random_state=0)
    clf.fit(_matrix(rows, categories), labels, sample_weight=None if weights is None else np.asarray(weights))
    t = clf.tree_
    nodes: list[dict[str, Any]] = []

    def emit(i: int) -> int:  # pre-order, so children get larger indices than their parent
        at = len(nodes)
        nodes.append({})
        if t.children_left[i] == -1:
            nodes[at] = {"config": int(clf.classes_[int(np.argmax(t.value[i][0]))])}
            return at
        name = names[t.feature[i]]
        left, right = emit(t.children_left[i]), emit(t.children_right[i])
        if name.startswith("category="):
            nodes[at] = {"feature": "category", "in": [name.split("=", 1)[1]], "left": left, "right": right}
        else:
            nodes[at] = {"feature": name, "threshold": float(t.threshold[i]), "left": left, "right": right}
        return at

    emit(0)
    return _collapse({"nodes": nodes})


def _collapse(rule: dict[str, Any]) -> dict[str, Any]:
    """Merge splits whose two sides pick the same configuration (sklearn keeps them when the split only sharpens
    class probabilities), so the stored rule says only what changes the choice."""
    nodes = rule["nodes"]

    def build(i: int, out: list[dict[str, Any]]) -> int:
        node = nodes[i]
        at = len(out)
        out.append({})
        if "config" in node:
            out[at] = dict(node)
            return at
        mark = len(out)
        left = build(node["left"], out)
        right = build(node["right"], out)
        if "config" in out[left] and "config" in out[right] and out[left] == out[right]:
            config = out[left]["config"]
            del out[mark:]
            out[at] = {"config": config}
            return at
        out[at] = {**node, "left": left, "right": right}
        return at

    out: list[dict[str, Any]] = []
    build(0, out)
    return {"nodes": out}
