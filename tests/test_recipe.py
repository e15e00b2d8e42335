"""Recipes: shipped presets validate, unknown keys name their path and the allowed keys, --set works."""

import pytest
import yaml

from quantkit.errors import RecipeError
from quantkit.recipe import available_recipes, load_recipe, validate_recipe


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
        ("stages.0.scheme.num_bits=5", "num_bits=5 is not supported"),
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
