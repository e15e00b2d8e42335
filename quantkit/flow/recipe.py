"""Recipes: typed, versioned YAML pipelines of quantization stages, with `--set` overrides.

A recipe is data only: it is parsed with `yaml.safe_load` and validated by pydantic models
that reject unknown keys, so nothing in a recipe can execute code.

A validated recipe is resolved once (`Recipe.resolved`): per stage the algorithm class,
its validated config and its resolved scheme, which the pipeline and `recipe.yaml` consume.

Overrides address a stage by index (`stages.0.scheme.group_size=64`) or by name
(`stages.gptq.scheme.group_size=64`): a stage's name is its `name:` field, else its algorithm
when no other stage of the recipe runs the same algorithm.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, PrivateAttr, ValidationError, create_model, model_validator

from quantkit.errors import QuantkitError, RecipeError
from quantkit.platform.paths import RECIPES_DIR
from quantkit.plugins import catalog
from quantkit.quant.schemes import QuantScheme, resolve_scheme
from quantkit.core.validation import StrictModel

if TYPE_CHECKING:
    from quantkit.algorithms.base import Algorithm

RECIPE_VERSION = 1


class _Strict(StrictModel):
    """Unknown keys are errors; booleans are not numbers."""


class _SchemeSpecBase(_Strict):
    """A preset name and/or explicit fields; `scheme: W4A16` is shorthand for `{preset: W4A16}`."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"preset": data} if isinstance(data, str) else data

    def resolve(self) -> QuantScheme:
        return resolve_scheme(self.preset, self.model_dump(exclude_unset=True, exclude={"preset"}))


def _spec_field(name: str, annotation: Any) -> tuple:
    if name == "input_activations":  # merged field by field with the preset's, then validated by QuantScheme
        return (Optional[dict[str, Any]], None)
    if name == "block_structure":
        return (Optional[list[int]], None)
    return (Optional[annotation], None)


# The recipe's `scheme:` is QuantScheme's fields, each optional (a preset fills the rest), plus `preset`:
# derived from QuantScheme so that a field added there is a recipe key at once.
SchemeSpec = create_model(
    "SchemeSpec", __base__=_SchemeSpecBase, preset=(Optional[str], None),
    **{name: _spec_field(name, f.annotation) for name, f in QuantScheme.model_fields.items()})


class CalibrationSpec(_Strict):
    # the shipped mix of languages, code and dialogues (`mix-v1`), `self` (text the model samples itself from
    # seed prompts), a shipped text name, a local .txt/.jsonl/.parquet, or a hub dataset
    dataset: str = "mix-v1"
    mix: Optional[dict[str, NonNegativeFloat]] = None  # a mix's parts' shares of the windows (default: the manifest's)
    # held-back windows per part (never calibrated on) for the per-domain check against round-to-nearest; 0: no check
    check_samples: NonNegativeInt = 2
    text_column: str = "text"  # column holding the text in .jsonl / .parquet / hub datasets
    encoding: str = "utf-8"  # of a .txt file
    num_samples: PositiveInt = 64
    seq_len: PositiveInt = 512
    seed: int = 0
    batch_size: PositiveInt = 4  # samples per calibration forward: peak memory (attention temporaries) vs speed
    # dtype of the calibration forwards; "auto" = the machine's fast dtype that holds the checkpoint's
    # weights exactly (`quantkit.platform.compute`: bf16 only where the hardware has it; on an AVX2 CPU a bf16
    # matmul is ~100x slower than float32). Hessians and other statistics are always float32.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"


class StageSpec(_Strict):
    algorithm: str
    name: Optional[str] = None  # to address the stage in overrides (default: its algorithm, when unique)
    scheme: Optional[SchemeSpec] = None
    targets: list[str] = Field(default_factory=lambda: ["Linear"])  # class names, module names or "re:<regex>"
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    args: dict[str, Any] = Field(default_factory=dict)  # validated by the algorithm's own Config


@dataclass(frozen=True)
class ResolvedStage:
    """One stage, resolved: what the pipeline builds it from and `recipe.yaml` writes."""

    index: int
    address: str  # how overrides name it: its name where it has one, else its index
    spec: StageSpec
    algorithm: type["Algorithm"]
    config: BaseModel  # the algorithm's Config, validated from spec.args
    scheme: Optional[QuantScheme]  # spec.scheme with its preset merged in (None for stages without one)
    # the group size was given by a --set item (recorded when the item was parsed): a layer it does not divide is
    # an error, where the recipe's own size falls back to a smaller one for that layer
    group_size_explicit: bool = False


class Recipe(_Strict):
    version: Literal[1] = RECIPE_VERSION
    name: str = "custom"
    description: str = ""
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    stages: list[StageSpec] = Field(min_length=1)
    _overrides: list[str] = PrivateAttr(default_factory=list)  # the --set items applied, in order
    _resolved: tuple[ResolvedStage, ...] = PrivateAttr(default=())  # set by validate_recipe
    # the data it was validated from, as written (schemes unresolved): what more overrides apply to
    _raw: Optional[dict] = PrivateAttr(default=None)

    @property
    def overrides(self) -> list[str]:
        return list(self._overrides)

    @property
    def resolved(self) -> tuple[ResolvedStage, ...]:
        """Each stage resolved (algorithm class, validated config, scheme): made once, when the recipe
        was validated."""
        if len(self._resolved) != len(self.stages):
            raise RecipeError("this recipe was not validated (use load_recipe or validate_recipe)")
        return self._resolved

    def stage_address(self, stage: int) -> str:
        """How overrides name stage `stage`: its name where it has one, else its index."""
        return self.resolved[stage].address

    def with_overrides(self, items: list[str]) -> "Recipe":
        """A copy with more `--set` items applied to the recipe as written (schemes not yet resolved, so
        `stages.0.scheme.preset=W8A16` or `...strategy=channel` mean what they mean on a recipe name),
        validated as a recipe read from a file is."""
        raw = copy.deepcopy(self._raw) if self._raw is not None else self.model_dump(mode="json", exclude_unset=True)
        raw, explicit = apply_overrides(raw, items)
        explicit |= {p.index for p in self.resolved if p.group_size_explicit}
        recipe = validate_recipe(raw, self.name, explicit)
        recipe._overrides = [*self._overrides, *items]
        return recipe

    def to_yaml(self, dataset: Optional[str] = None) -> str:
        """The recipe with defaults filled in and schemes resolved to explicit fields; a comment
        at the top names the --set overrides that were applied. dataset: calibration data the recipe does
        not name (texts or token ids given to `quantkit.quantize`), written as calibration.dataset."""
        data = self.model_dump(mode="json")
        if dataset is not None:
            data["calibration"]["dataset"] = dataset
        for stage, planned in zip(data["stages"], self.resolved):
            stage["scheme"] = planned.scheme.model_dump(mode="json") if planned.scheme is not None else None
            if stage.get("name") is None:
                stage.pop("name", None)
        head = "".join(f"# --set {item}\n" for item in self._overrides)
        head = f"# recipe {self.name} with these overrides applied:\n{head}" if head else ""
        return head + yaml.safe_dump(data, sort_keys=False)


def available_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def recipe_source(name_or_path: str) -> Path:
    """A recipe name from recipes/, or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise RecipeError(f"recipe file {name_or_path!r} does not exist")
        return path
    known = available_recipes()
    if name_or_path not in known:
        raise RecipeError(
            f"unknown recipe {name_or_path!r}; available: {', '.join(known) or '(none)'} "
            "(or pass a path to a .yaml file)"
        )
    return known[name_or_path]


def load_recipe(name_or_path: str, overrides: Optional[list[str]] = None) -> Recipe:
    """Read, override (`key.path=value` strings) and validate a recipe."""
    path = recipe_source(name_or_path)
    label = name_or_path if path.parent == RECIPES_DIR else str(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {label}: not valid YAML: {exc}") from None
    if raw is None:
        raise RecipeError(f"recipe {label}: the file is empty (or only comments); a recipe needs at least "
                          "`version: 1` and `stages:` (see `quantkit recipes` for the shipped ones to start from)")
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {label}: expected a mapping at the top level, got {type(raw).__name__}")
    raw, explicit = apply_overrides(raw, list(overrides or []))
    recipe = validate_recipe(raw, label, explicit)
    recipe._overrides = list(overrides or [])
    return recipe


def validate_recipe(raw: dict, label: str = "recipe", explicit_group_sizes: frozenset = frozenset()) -> Recipe:
    """A recipe from its data; `explicit_group_sizes`: the stages whose group size a --set item gave."""
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(_format_errors(label, exc, Recipe)) from None
    recipe._raw = copy.deepcopy(raw)
    names = {i: n for n, i in stage_names([st.model_dump() for st in recipe.stages]).items()}
    recipe._resolved = tuple(_resolve_stage(label, i, stage, names.get(i, str(i)), i in explicit_group_sizes)
                             for i, stage in enumerate(recipe.stages))
    seen: dict[str, int] = {}
    for i, stage in enumerate(recipe.stages):
        if stage.name is None:
            continue
        if not stage.name.strip() or stage.name.lstrip("-").isdigit() or "." in stage.name or "=" in stage.name:
            raise RecipeError(f"recipe {label}: stages.{i}.name {stage.name!r}: a name is a word (not a number, "
                              "no '.' or '='), e.g. gptq or weights")
        if stage.name in seen:
            raise RecipeError(f"recipe {label}: stages.{i}.name {stage.name!r} is the name of stage {seen[stage.name]} "
                              "too; stage names are unique")
        seen[stage.name] = i
    return recipe


def stage_names(stages: list) -> dict[str, int]:
    """name -> index of each addressable stage (raw recipe dicts): its `name`, else its algorithm when no
    other stage runs that algorithm (and no stage is named so)."""
    dicts = [s if isinstance(s, dict) else {} for s in stages]
    explicit = {str(s["name"]): i for i, s in enumerate(dicts) if s.get("name")}
    counts = Counter(s.get("algorithm") for s in dicts)
    out = dict(explicit)
    for i, s in enumerate(dicts):
        algo = s.get("algorithm")
        if not s.get("name") and isinstance(algo, str) and counts[algo] == 1 and algo not in explicit:
            out[algo] = i
    return out


def _resolve_stage(label: str, i: int, stage: StageSpec, address: str, explicit: bool) -> ResolvedStage:
    """Validate stage i and resolve it (the only place a recipe's scheme is resolved)."""
    if stage.algorithm not in catalog.algorithm_names():
        raise RecipeError(
            f"recipe {label}: stages.{i}.algorithm: unknown algorithm {stage.algorithm!r}; "
            f"known: {', '.join(catalog.algorithm_names())}"
        )
    algo = catalog.algorithm(stage.algorithm)
    try:
        config = algo.Config.model_validate(stage.args)
    except ValidationError as exc:
        raise RecipeError(_format_errors(label, exc, algo.Config, prefix=f"stages.{i}.args")) from None
    if algo.produces_weights and stage.scheme is None:
        raise RecipeError(f"recipe {label}: stages.{i}.scheme is required by algorithm {stage.algorithm!r}")
    scheme = None
    if stage.scheme is not None:
        try:
            scheme = stage.scheme.resolve()
        except (ValidationError, ValueError, QuantkitError) as exc:
            msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise RecipeError(f"recipe {label}: stages.{i}.scheme: {msg}") from None
        if scheme.actorder == "group":
            raise RecipeError(f"recipe {label}: stages.{i}.scheme.actorder: 'group' (a g_idx per column) is how "
                              "act-order checkpoints are read; quantize with actorder: static (the same order, "
                              "groups kept contiguous)")
        if scheme.actorder and not algo.supports_actorder:
            raise RecipeError(f"recipe {label}: stages.{i}.scheme.actorder: algorithm {stage.algorithm!r} "
                              "has no column order; drop actorder or use gptq")
        if algo.produces_weights and not algo.quantizes(scheme):
            able = [n for n in catalog.algorithm_names() if catalog.algorithm(n).quantizes(scheme)]
            raise RecipeError(
                f"recipe {label}: stages.{i}: algorithm {stage.algorithm!r} does not quantize "
                f"{scheme.micro_name.upper() if scheme.is_micro else 'FP8' if scheme.is_fp8 else 'int'} schemes; "
                f"algorithms that do: {', '.join(able)}")
    return ResolvedStage(i, address, stage, algo, config, scheme, explicit)


def _format_errors(label: str, exc: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
        where = ".".join(([prefix] if prefix else []) + loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(root, err["loc"][:-1])
            lines.append(f"{where}: unknown key; allowed keys: {', '.join(allowed)}")
        else:
            lines.append(f"{where}: {err['msg']}")
    return f"recipe {label} is invalid:\n  " + "\n  ".join(lines)


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the model found by walking `loc` (skipping list indices) from `model`."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        field = current.model_fields.get(part)
        if field is None:
            break
        current = _inner_model(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside Optional[...] / list[...] annotations, else the annotation."""
    args = getattr(annotation, "__args__", None)
    if args:
        for arg in args:
            inner = _inner_model(arg)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return annotation


def apply_overrides(raw: dict, items: list[str]) -> tuple[dict, frozenset]:
    """raw with every `--set` item applied in order, and the stages whose group size an item gave (a
    `stages.<i>.scheme.group_size` or a whole `stages.<i>.scheme`), found as the item is parsed."""
    explicit = set()
    for item in items:
        raw = apply_override(raw, item)
        parts = item.partition("=")[0].strip().split(".")
        if parts[0] == "stages" and len(parts) >= 3 and parts[2:] in (["scheme", "group_size"], ["scheme"]):
            explicit.add(_index(raw["stages"], parts[1], item, stages=True) % len(raw["stages"]))
    return raw, frozenset(explicit)


def apply_override(raw: dict, item: str) -> dict:
    """`stages.0.scheme.group_size=64` -> raw with that value set (value parsed as YAML)."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. stages.0.scheme.group_size=64")
    key, _, text = item.partition("=")
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise RecipeError(f"--set {item!r}: empty component in key {key!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise RecipeError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    out = copy.deepcopy(raw)
    node: Union[dict, list] = out
    for depth, part in enumerate(parts[:-1]):
        node = _descend(node, part, parts[: depth + 1], item)
    _assign(node, parts[-1], value, item, stages=parts[:-1] == ["stages"])
    return out


def _descend(node: Union[dict, list], part: str, path: list[str], item: str) -> Union[dict, list]:
    if isinstance(node, list):
        idx = _index(node, part, item, stages=path[:-1] == ["stages"])
        return node[idx]
    child = node.get(part)
    if child is None:
        child = node[part] = {}
    elif isinstance(child, str) and part == "scheme":
        child = node[part] = {"preset": child}  # expand the shorthand so fields can be set
    elif not isinstance(child, (dict, list)):
        raise RecipeError(f"--set {item!r}: {'.'.join(path)} is a value ({child!r}), not a section")
    return child


def _assign(node: Union[dict, list], part: str, value: Any, item: str, stages: bool = False) -> None:
    if isinstance(node, list):
        node[_index(node, part, item, stages)] = value
    else:
        node[part] = value


def _index(node: list, part: str, item: str, stages: bool = False) -> int:
    """A list position: an index, or (in `stages`) a stage's name."""
    if stages and not part.lstrip("-").isdigit():
        names = stage_names(node)
        if part in names:
            return names[part]
        listed = ", ".join(f"{i} {s.get('name') or s.get('algorithm')}" if isinstance(s, dict) else str(i)
                           for i, s in enumerate(node))
        same = [i for i, s in enumerate(node) if isinstance(s, dict) and s.get("algorithm") == part]
        why = (f"{len(same)} stages run {part!r} (give them `name:` fields, or use an index)" if len(same) > 1
               else f"no stage is named {part!r}")
        raise RecipeError(f"--set {item!r}: {why}; the stages are {listed}; address one by name or index")
    if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
        raise RecipeError(f"--set {item!r}: {part!r} is not an index of a list of {len(node)} items")
    return int(part)
