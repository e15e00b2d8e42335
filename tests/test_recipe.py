"""Recipes: shipped presets validate, unknown keys name their path and the allowed keys, --set works."""

import pytest
import yaml

from quantkit.errors import RecipeError
from quantkit.flow.recipe import available_recipes, load_recipe, validate_recipe


def test_shipped_recipes_validate():
    names = set(available_recipes())
    assert {"rtn-w4a16", "rtn-w8a16"} <= names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.stages


def test_presets_resolve():
    w4 = load_recipe("rtn-w4a16").stages[0].scheme.resolve()
    assert (w4.num_bits, w4.symmetric, w4.strategy, w4.group_size) == (4, True, "group", 128)
    w8 = load_recipe("rtn-w8a16").stages[0].scheme.resolve()
    assert (w8.num_bits, w8.strategy, w8.group_size) == (8, "channel", None)


def test_override_group_size_expands_preset_shorthand():
    recipe = load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=64", "calibration.num_samples=8"])
    scheme = recipe.stages[0].scheme.resolve()
    assert scheme.group_size == 64 and scheme.num_bits == 4
    assert recipe.calibration.num_samples == 8


def test_override_to_channel_drops_preset_group_size():
    scheme = load_recipe("rtn-w4a16", ["stages.0.scheme.strategy=channel"]).stages[0].scheme.resolve()
    assert scheme.strategy == "channel" and scheme.group_size is None


def test_unknown_key_names_path_and_allowed_keys():
    with pytest.raises(RecipeError) as exc:
        load_recipe("rtn-w4a16", ["stages.0.scheme.grop_size=64"])
    msg = str(exc.value)
    assert "stages.0.scheme.grop_size" in msg and "unknown key" in msg
    assert "group_size" in msg and "num_bits" in msg  # the allowed keys are listed


def test_unknown_top_level_key(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"version": 1, "stages": [{"algorithm": "rtn", "scheme": "W4A16"}], "stagse": []}))
    with pytest.raises(RecipeError, match=r"stagse: unknown key; allowed keys: version, name"):
        load_recipe(str(f))


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("stages.0.scheme.num_bits=9", "num_bits=9 is not supported"),
        ("stages.0.algorithm=gptx", "unknown algorithm 'gptx'"),
        ("stages.0.scheme.preset=W5", "unknown scheme preset 'W5'"),
        ("stages.0.args.foo=1", "stages.0.args.foo: unknown key"),
        ("stages.3.scheme.group_size=64", "not an index of a list of 1 items"),
        ("stages.0.scheme.group_size", "expected KEY.PATH=VALUE"),
        ("version=2", "version"),
        ("calibration.num_samples=0", "calibration.num_samples"),
    ],
)
def test_invalid_overrides(override, fragment):
    with pytest.raises(RecipeError, match=None) as exc:
        load_recipe("rtn-w4a16", [override])
    assert fragment in str(exc.value)


def test_channel_with_group_size_is_an_error():
    with pytest.raises(RecipeError, match="strategy 'channel' takes no group_size"):
        load_recipe("rtn-w8a16", ["stages.0.scheme.group_size=64"])


def test_unknown_recipe_lists_available():
    with pytest.raises(RecipeError, match="rtn-w4a16"):
        load_recipe("no-such-recipe")


def test_invalid_yaml_and_non_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(bad))
    bad.write_text("- just a list")
    with pytest.raises(RecipeError, match="expected a mapping"):
        load_recipe(str(bad))


def test_yaml_cannot_execute_code(tmp_path):
    f = tmp_path / "evil.yaml"
    f.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(f))


def test_to_yaml_round_trips_with_resolved_scheme():
    recipe = load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"])
    again = validate_recipe(yaml.safe_load(recipe.to_yaml()))
    assert again.stages[0].scheme.resolve() == recipe.stages[0].scheme.resolve()
    assert yaml.safe_load(recipe.to_yaml())["stages"][0]["scheme"]["group_size"] == 32


# --- stages addressed by name ------------------------------------------------------------------

def _schemes(recipe):
    return [s.scheme.resolve() if s.scheme else None for s in recipe.stages]


@pytest.mark.parametrize("recipe, by_name, by_index", [
    ("gptq-w4a16", "stages.gptq.scheme.group_size=64", "stages.0.scheme.group_size=64"),
    ("awq-w4a16", "stages.rtn.scheme.group_size=64", "stages.1.scheme.group_size=64"),
    ("awq-gptq-w4a16", "stages.gptq.scheme.group_size=32", "stages.1.scheme.group_size=32"),
    ("awq-w4a16", "stages.awq.args.n_grid=10", "stages.0.args.n_grid=10"),
])
def test_a_stage_is_addressed_by_its_algorithm(recipe, by_name, by_index):
    named, indexed = load_recipe(recipe, [by_name]), load_recipe(recipe, [by_index])
    assert _schemes(named) == _schemes(indexed) and [s.args for s in named.stages] == [s.args for s in indexed.stages]
    assert _schemes(named) != _schemes(load_recipe(recipe)) or named.stages[0].args != load_recipe(recipe).stages[0].args
    stage = int(by_index.split(".")[1])
    explicit = [named.resolved[stage].group_size_explicit, indexed.resolved[stage].group_size_explicit]
    assert explicit == [("group_size" in by_name)] * 2


TWO_RTN = {"stages": [
    {"algorithm": "rtn", "scheme": "W4A16", "targets": ["re:.*mlp.*"]},
    {"algorithm": "rtn", "scheme": "W4A16_ASYM", "targets": ["re:.*self_attn.*"]},
]}


def test_stages_with_the_same_algorithm_need_names(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(TWO_RTN))
    with pytest.raises(RecipeError, match=r"2 stages run 'rtn' \(give them `name:` fields, or use an index\); "
                                          r"the stages are 0 rtn, 1 rtn"):
        load_recipe(str(path), ["stages.rtn.scheme.group_size=64"])
    named = {"stages": [{**TWO_RTN["stages"][0], "name": "mlp"}, {**TWO_RTN["stages"][1], "name": "attention"}]}
    path.write_text(yaml.safe_dump(named))
    recipe = load_recipe(str(path), ["stages.attention.scheme.group_size=32"])
    assert [s.group_size for s in _schemes(recipe)] == [128, 32]
    assert recipe.stage_address(1) == "attention" and recipe.resolved[1].group_size_explicit
    assert not recipe.resolved[0].group_size_explicit
    again = validate_recipe(yaml.safe_load(recipe.to_yaml()))
    assert [s.name for s in again.stages] == ["mlp", "attention"]
    assert all("name" not in st for st in yaml.safe_load(load_recipe("gptq-w4a16").to_yaml())["stages"])


def test_unknown_and_bad_stage_names():
    with pytest.raises(RecipeError, match=r"no stage is named 'gtpq'; the stages are 0 gptq; address one by name"):
        load_recipe("gptq-w4a16", ["stages.gtpq.scheme.group_size=64"])
    dup = {"stages": [{**TWO_RTN["stages"][0], "name": "w"}, {**TWO_RTN["stages"][1], "name": "w"}]}
    with pytest.raises(RecipeError, match=r"stages.1.name 'w' is the name of stage 0 too"):
        validate_recipe(dup)
    numeric = {"stages": [{**TWO_RTN["stages"][0], "name": "1"}]}
    with pytest.raises(RecipeError, match=r"stages.0.name '1': a name is a word"):
        validate_recipe(numeric)


def test_a_recipe_is_resolved_once_into_its_plan(tiny_llama):
    """Recipe.resolved: per stage the algorithm class, its validated config and the resolved scheme, made
    when the recipe is validated; the pipeline builds its stages from it and recipe.yaml writes it."""
    import torch

    import quantkit
    from quantkit.algorithms.awq import AWQ
    from quantkit.algorithms.rtn import RTN
    from quantkit.plugins.catalog import adapter_for
    from quantkit.flow.pipeline import build_stages
    from quantkit.flow.recipe import Recipe

    recipe = load_recipe("awq-w4a16", ["stages.rtn.scheme.group_size=32", "stages.awq.args.n_grid=7"])
    awq, rtn = recipe.resolved
    assert (awq.algorithm, rtn.algorithm) == (AWQ, RTN) and (awq.address, rtn.address) == ("awq", "rtn")
    assert awq.scheme is None and awq.config.n_grid == 7
    assert rtn.scheme == rtn.spec.scheme.resolve() and rtn.scheme.group_size == 32
    assert yaml.safe_load(recipe.to_yaml())["stages"][1]["scheme"] == rtn.scheme.model_dump(mode="json")
    model = quantkit.load(tiny_llama, dtype=torch.float32)
    stages = build_stages(model, adapter_for("llama"), recipe)
    assert stages[0].algorithm.config is awq.config and stages[1].algorithm.scheme is rtn.scheme
    assert [s.address for s in stages] == ["awq", "rtn"]
    with pytest.raises(RecipeError, match="was not validated"):
        Recipe.model_construct(stages=recipe.stages).resolved


def test_an_explicit_group_size_is_recorded_when_the_item_is_parsed():
    """--set items that give a group size mark their stage as they are applied (also on a Recipe object, and
    kept through later overrides); the recipe's own size is not explicit."""
    plain = load_recipe("awq-w4a16")
    assert not any(s.group_size_explicit for s in plain.resolved)
    by_object = plain.with_overrides(["stages.rtn.scheme.group_size=64"])
    assert [s.group_size_explicit for s in by_object.resolved] == [False, True]
    later = by_object.with_overrides(["calibration.num_samples=8"])
    assert [s.group_size_explicit for s in later.resolved] == [False, True]
    whole = load_recipe("rtn-w4a16", ["stages.0.scheme={preset: W4A16, group_size: 32}"])
    assert whole.resolved[0].group_size_explicit
    assert not load_recipe("rtn-w4a16", ["stages.0.scheme.num_bits=8"]).resolved[0].group_size_explicit
