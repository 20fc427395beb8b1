"""Golden tests of the qaic-compile command lines and the compile options."""

from __future__ import annotations

import json

import pytest

from dflash_cli.errors import RecipeError
from dflash_cli.qaic.command import CompilerTool, QaicCompileOptions, compiler_command
from dflash_cli.qaic.specs import partition_config
from tests.qaic_golden import argv_text, assert_golden

COMPILE = CompilerTool("/opt/qti-aic/exec/qaic-compile")
EXEC = CompilerTool("/opt/qti-aic/exec/qaic-exec", compile_only=True)
ALL_FLAGS = QaicCompileOptions(
    num_cores=14, mxfp6_matmul=True, mxint8_kv_cache=True, mos=1, ols=2, aic_enable_depth_first=True
)


def _cmd(tool: CompilerTool, graph: str, options: QaicCompileOptions, **kw: object) -> list[str]:
    kw = {"hw_version": "ai100", "has_local_functions": False, **kw}
    return compiler_command(tool, f"/export/{graph}.onnx", f"/out/{graph}", options, **kw)  # type: ignore[arg-type]


def test_target_single_device_defaults() -> None:
    assert_golden("cmd_target_single.txt", argv_text(_cmd(COMPILE, "target", QaicCompileOptions())))


def test_draft_single_device_defaults() -> None:
    assert_golden("cmd_draft_single.txt", argv_text(_cmd(COMPILE, "draft", QaicCompileOptions())))


def test_all_optional_flags_ai200() -> None:
    cmd = _cmd(COMPILE, "target", ALL_FLAGS, hw_version="ai200")
    assert_golden("cmd_target_all_flags.txt", argv_text(cmd))
    # mxint8 has no flag: it lives in custom_io.yaml.
    assert not any("int8" in a for a in cmd)


def test_two_devices_adds_partition_config() -> None:
    options = QaicCompileOptions(devices=[2, 3])
    assert_golden("cmd_target_two_devices.txt", argv_text(_cmd(COMPILE, "target", options)))
    assert_golden("mdp_partition_two_devices.json", json.dumps(partition_config(2, 16), indent=2) + "\n")


def test_qaic_exec_fallback_adds_compile_only() -> None:
    cmd = _cmd(EXEC, "draft", QaicCompileOptions())
    assert_golden("cmd_draft_qaic_exec.txt", argv_text(cmd))
    assert cmd[-1] == "-compile-only" and cmd.count("-compile-only") == 1
    assert "-compile-only" not in _cmd(COMPILE, "draft", QaicCompileOptions())


def test_sub_functions_only_with_local_functions() -> None:
    assert "-sub-functions" in _cmd(COMPILE, "target", QaicCompileOptions(), has_local_functions=True)
    assert "-sub-functions" not in _cmd(COMPILE, "target", QaicCompileOptions())


def test_options_from_mapping_and_key_fields() -> None:
    options = QaicCompileOptions.from_mapping({"num_cores": 8, "devices": [4, 5], "mxint8_kv_cache": True})
    assert options.devices == (4, 5) and options.num_devices == 2 and options.kv_precision == "mxint8"
    key = options.key_fields()
    # The compiled program depends on the device count, not on which QIDs run it.
    assert "devices" not in key and key["num_devices"] == 2
    assert (
        QaicCompileOptions.from_mapping({"devices": [0, 1]}).key_fields()
        == QaicCompileOptions(devices=(7, 9)).key_fields()
    )
    assert QaicCompileOptions.from_mapping(None) == QaicCompileOptions()


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"num_cores": 0}, "num_cores"),
        ({"num_cores": True}, "num_cores"),
        ({"mos": -1}, "mos"),
        ({"aic_hw_version": "2.0"}, "aic_hw_version"),
        ({"devices": []}, "devices"),
        ({"devices": [0, 0]}, "devices"),
        ({"devices": 0}, "devices"),
        ({"specialization_format": "flat"}, "specialization_format"),
        ({"num_core": 4}, "unknown compile.qaic option"),
    ],
)
def test_invalid_options_are_recipe_errors(data: dict, fragment: str) -> None:
    with pytest.raises(RecipeError, match=fragment):
        QaicCompileOptions.from_mapping(data)


def test_two_programs_on_one_card_split_its_cores() -> None:
    shared = QaicCompileOptions.from_mapping({"num_cores": 16, "devices": [0]})
    assert shared.placement() == {"target": (8, (0,)), "draft": (8, (0,))}
    assert shared.for_graph("draft").num_cores == 8 and shared.for_graph("draft").devices == (0,)
    apart = QaicCompileOptions.from_mapping({"num_cores": 16, "devices": [0], "draft": {"devices": [1]}})
    assert apart.placement() == {"target": (16, (0,)), "draft": (16, (1,))}
    own = QaicCompileOptions.from_mapping({"num_cores": 16, "target": {"num_cores": 12}, "draft": {"num_cores": 4}})
    assert own.placement() == {"target": (12, (0,)), "draft": (4, (0,))}
    assert own.key_fields()["placement"] == {
        "target": {"num_cores": 12, "num_devices": 1},
        "draft": {"num_cores": 4, "num_devices": 1},
    }


def test_core_over_subscription_is_refused_with_the_numbers() -> None:
    from dflash_cli.errors import BackendError

    both = QaicCompileOptions.from_mapping({"target": {"num_cores": 16}, "draft": {"num_cores": 16}})
    with pytest.raises(BackendError) as info:
        both.check_fit(16)
    assert "device 0 has 16 cores but the programs placed on it ask for 32 (target 16 + draft 16)" in info.value.message
    assert "compile.qaic.draft.devices" in info.value.hint
    both.check_fit({0: 32})  # a bigger card (qaic-util's count) holds both
    both.check_fit(None)  # unknown hardware: nothing to check against
    QaicCompileOptions.from_mapping({}).check_fit(16)  # the default 8 + 8 fits one card


def test_bad_per_program_placement() -> None:
    with pytest.raises(RecipeError, match="draft.devices"):
        QaicCompileOptions.from_mapping({"draft": {"devices": [1, 1]}})
    with pytest.raises(RecipeError, match="target.num_cores"):
        QaicCompileOptions.from_mapping({"target": {"num_cores": 0}})


def test_a_vision_program_takes_its_share_of_the_card() -> None:
    """A vision-language target's tower is a third program: by default target 8, draft 4, vision 4 of 16; its
    own cores and card are settable, and three programs that do not fit one card are refused."""
    from dflash_cli.errors import BackendError

    default = QaicCompileOptions.from_mapping({})
    assert default.placement(vision=True) == {"target": (8, (0,)), "draft": (4, (0,)), "vision": (4, (0,))}
    assert default.placement() == {"target": (8, (0,)), "draft": (8, (0,))}  # no tower: the pair as before
    default.check_fit(16, vision=True)
    assert default.for_graph("vision", vision=True).num_cores == 4
    own = QaicCompileOptions.from_mapping({"vision": {"num_cores": 2, "devices": [1]}, "draft": {"num_cores": 8}})
    assert own.placement(vision=True)["vision"] == (2, (1,))
    with pytest.raises(BackendError) as info:
        QaicCompileOptions.from_mapping({"vision": {"num_cores": 8}}).check_fit(16, vision=True)
    assert "(target 16 + draft 16 + vision 8)" in info.value.message and "compile.qaic.vision" in info.value.hint
