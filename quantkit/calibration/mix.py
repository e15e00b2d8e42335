"""Shipped text collections: the calibration mix (`mix-v1`) and the evaluation set (`eval-v1`).

A collection is a directory with a `manifest.json` (written by calibration_data/build_mix.py) naming its parts:
each part one language and domain (English novels, a technical manual in six languages, Python source,
dialogues), with its source package, licence and sha256. A part's file is checked against its sha256 when read.
Dialogue parts (`kind: chat`) hold messages and become text through the model's own chat template.

Calibration from a mix takes `num_samples` windows split over the parts by weight (largest remainder), each
part's windows chosen by a seeded permutation of its non-overlapping windows; the windows after those in the
same permutation are held back (never calibrated on) for the per-domain check at the end of a run.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from quantkit.errors import CalibrationDataError
from quantkit.platform.paths import CALIBRATION_DIR, EVAL_DATA_DIR

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


@dataclass(frozen=True)
class Part:
    """One file of a collection: a language and domain."""

    name: str
    kind: str  # "text" or "chat"
    language: str
    domain: str
    path: Path
    sha256: str
    weight: float = 0.0  # share of the calibration windows (calibration mixes only)


@dataclass(frozen=True)
class Collection:
    name: str
    role: str  # "calibration" or "evaluation"
    parts: tuple[Part, ...]

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise CalibrationDataError(f"{self.name} has no part {name!r} (parts: {', '.join(self.names())})")

    def names(self) -> list[str]:
        return [p.name for p in self.parts]


def collections() -> dict[str, Path]:
    """Shipped collections by name: calibration_data/*/manifest.json and evals/data/*/manifest.json."""
    found = {}
    for root in (CALIBRATION_DIR, EVAL_DATA_DIR):
        for manifest in sorted(root.glob("*/manifest.json")):
            found[manifest.parent.name] = manifest
    return found


def is_collection(name: str) -> bool:
    return name in collections()


def load_collection(name: str) -> Collection:
    """The shipped collection `name` (its manifest read; the parts' files are checked when read)."""
    manifest = collections().get(name)
    if manifest is None:
        raise CalibrationDataError(f"no shipped collection {name!r} (shipped: {', '.join(collections())})")
    raw = json.loads(manifest.read_text(encoding="utf-8"))
    parts = tuple(Part(p["name"], p["kind"], p["language"], p["domain"], (manifest.parent / p["file"]).resolve(),
                       p["sha256"], float(p.get("weight", 0.0))) for p in raw["parts"])
    return Collection(raw["name"], raw["role"], parts)


def read_part(part: Part) -> str:
    """A part's file contents, refused when they are not what the manifest recorded."""
    data = part.path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != part.sha256:
        raise CalibrationDataError(
            f"{part.path} is not the file its manifest records (sha256 {digest[:16]}, recorded {part.sha256[:16]}): "
            "restore it (git checkout) or rebuild the collection with calibration_data/build_mix.py")
    return data.decode("utf-8")


def dialogues(part: Part) -> list[list[dict]]:
    """A chat part's dialogues: each a list of {role, content} messages."""
    return [json.loads(line)["messages"] for line in read_part(part).splitlines() if line.strip()]


def render_dialogue(messages: list[dict], tokenizer) -> str:
    """One dialogue as the model sees it: through its chat template, or `Role: content` lines when it has none."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n\n".join(f"{PLAIN_ROLES.get(m['role'], m['role'])}: {m['content']}" for m in messages)


def part_text(part: Part, tokenizer) -> tuple[str, Optional[str]]:
    """(the part as text for `tokenizer`'s model, a note when dialogues fell back to plain rendering)."""
    if part.kind != "chat":
        return read_part(part), None
    rendered = [render_dialogue(m, tokenizer) for m in dialogues(part)]
    note = None
    if not getattr(tokenizer, "chat_template", None):
        note = (f"{part.name}: the tokenizer has no chat template; its dialogues are rendered as 'User: ... "
                "Assistant: ...' lines")
    return "\n\n".join(rendered), note


def weights(collection: Collection, override: Optional[Mapping[str, float]] = None) -> dict[str, float]:
    """Each part's share of the windows (sum 1): the manifest's, or `override` (calibration.mix; parts it does not
    name get none)."""
    if override is None:
        chosen = {p.name: p.weight for p in collection.parts}
    else:
        unknown = sorted(set(override) - set(collection.names()))
        if unknown:
            raise CalibrationDataError(f"calibration.mix names {', '.join(unknown)}, not parts of {collection.name} "
                                       f"(parts: {', '.join(collection.names())})")
        bad = {k: v for k, v in override.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)}
        if bad:
            raise CalibrationDataError(f"calibration.mix weights must be finite numbers >= 0; got {bad}")
        chosen = {p.name: float(override.get(p.name, 0.0)) for p in collection.parts}
    total = sum(chosen.values())
    if total <= 0:
        raise CalibrationDataError(f"calibration.mix gives every part of {collection.name} weight 0; give one a "
                                   "positive weight")
    return {k: v / total for k, v in chosen.items()}


def allocate(shares: Mapping[str, float], n: int) -> dict[str, int]:
    """n windows split by share, largest remainder first (ties by order); parts with share 0 get none."""
    exact = {k: s * n for k, s in shares.items()}
    counts = {k: int(math.floor(v)) for k, v in exact.items()}
    order = sorted(exact, key=lambda k: -(exact[k] - counts[k]))
    for k in order[: n - sum(counts.values())]:
        counts[k] += 1
    return counts
