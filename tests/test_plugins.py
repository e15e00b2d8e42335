"""Registries and third-party plugins from the `quantkit.plugins` entry point group."""

import textwrap

import pytest

from quantkit.plugins import catalog

from quantkit.core import registry  # catalog: importing it registers the built-ins
from quantkit.errors import PluginError, UnknownNameError
from quantkit.core.registry import ALGORITHMS, ARCHITECTURES, FORMATS


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Install a fake distribution (dist-info + module) on sys.path; returns a writer for its module."""

    def make(module_source: str, entry: str = "demo = quantkit_test_plugin") -> None:
        (tmp_path / "quantkit_test_plugin.py").write_text(textwrap.dedent(module_source))
        info = tmp_path / "quantkit_test_plugin-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: quantkit-test-plugin\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[quantkit.plugins]\n{entry}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        registry.reset_for_tests()

    yield make
    import sys

    sys.modules.pop("quantkit_test_plugin", None)
    registry.reset_for_tests()


def test_builtins_registered():
    assert "rtn" in ALGORITHMS and "pack-quantized" in FORMATS
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"} <= set(ARCHITECTURES.names())
    assert all(e.source == "quantkit" for e in ALGORITHMS.entries())


def test_unknown_name_lists_known():
    with pytest.raises(UnknownNameError, match="unknown algorithm 'nope'; known algorithms: .*rtn"):
        ALGORITHMS.get("nope")


def test_duplicate_registration_is_an_error():
    with pytest.raises(PluginError, match="registered twice"):
        ALGORITHMS.add("rtn", object())


def test_third_party_plugin_registers_with_its_source(fake_dist):
    fake_dist(
        """
        from quantkit.algorithms.rtn import RTN
        from quantkit.core.registry import ALGORITHMS

        @ALGORITHMS.register("test-rtn")
        class TestRTN(RTN):
            name = "test-rtn"
        """
    )
    assert ALGORITHMS.get("test-rtn").name == "test-rtn"
    entry = next(e for e in ALGORITHMS.entries() if e.name == "test-rtn")
    assert "plugin 'demo'" in entry.source and "quantkit_test_plugin" in entry.source


def test_broken_plugin_names_itself(fake_dist):
    fake_dist("import this_module_does_not_exist_anywhere\n", entry="broken = quantkit_test_plugin")
    with pytest.raises(PluginError) as exc:
        ALGORITHMS.get("rtn")
    assert "plugin 'broken' (quantkit_test_plugin)" in str(exc.value)
    assert "this_module_does_not_exist_anywhere" in str(exc.value)


def test_callable_entry_point_is_called(fake_dist):
    fake_dist(
        """
        def register():
            from quantkit.arch.adapter import ArchitectureAdapter
            from quantkit.core.registry import ARCHITECTURES
            ARCHITECTURES.add("toy", ArchitectureAdapter(model_type="toy"))
        """,
        entry="toy = quantkit_test_plugin:register",
    )
    assert ARCHITECTURES.get("toy").model_type == "toy"


def test_an_algorithm_declares_its_kind():
    from quantkit.algorithms.base import Algorithm

    assert {n: ALGORITHMS.get(n).kind for n in ("rtn", "gptq", "fp8", "awq", "kv_cache")} == {
        "rtn": "weights", "gptq": "weights", "fp8": "weights", "awq": "transform", "kv_cache": "attention"}
    assert [ALGORITHMS.get(n).produces_weights for n in ("rtn", "awq", "kv_cache")] == [True, False, False]

    class OldStyle(Algorithm):  # a plugin written before `kind`
        name = "old-style"
        produces_weights = False

    assert OldStyle.kind == "transform" and OldStyle.produces_weights is False
    with pytest.raises(TypeError, match="kind 'weight' is not one of weights, transform, attention"):
        type("Typo", (Algorithm,), {"name": "typo", "kind": "weight"})


def test_whether_fp8_needs_data_follows_its_scheme():
    from quantkit.quant.schemes import resolve_scheme

    fp8 = ALGORITHMS.get("fp8")
    assert not fp8(fp8.Config(), resolve_scheme("FP8_DYNAMIC", {})).needs_data()
    assert fp8(fp8.Config(), resolve_scheme("FP8", {})).needs_data()
