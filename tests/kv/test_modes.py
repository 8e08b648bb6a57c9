"""The modes' answers (remnant.kv.modes), as docs/architecture.md's table states them."""

import pytest

from remnant.config_errors import ConfigError
from remnant.kv.formats import NATIVE_RECORD_BYTES, RETENTION_VALUES, packed_record_bytes
from remnant.kv.modes import MODE_NAMES, check_packed_rules, mode_of


def test_names_in_the_order_users_see_them():
    assert MODE_NAMES == ("native", "triton", "kernel")


@pytest.mark.parametrize(("name", "packed", "keeps", "direct", "reconstructs", "retentions"), [
    ("native", False, False, False, False, ()),
    ("triton", True, True, False, True, RETENTION_VALUES),
    ("kernel", True, True, True, False, (256,)),
])
def test_each_mode_answers(name, packed, keeps, direct, reconstructs, retentions):
    mode = mode_of(name)
    assert (mode.name, mode.packed, mode.keeps_retention, mode.direct_decode, mode.reconstructs, mode.retentions) == (
        name, packed, keeps, direct, reconstructs, retentions)
    assert mode.record_bytes(192) == (packed_record_bytes(192) if packed else NATIVE_RECORD_BYTES)


def test_a_name_that_is_no_mode_names_the_field_and_the_modes():
    with pytest.raises(ConfigError, match="^mode=fast is not a mode; allowed: native, triton, kernel$"):
        mode_of("fast")
    with pytest.raises(ConfigError, match="^REMNANT_MODE=packed is not a mode"):
        mode_of("packed", "REMNANT_MODE")
    with pytest.raises(ConfigError, match=r"^mode=\['kernel'\] is not a mode"):
        mode_of(["kernel"])


def test_retention_rules():
    mode_of("triton").check_retention([64, 448])
    with pytest.raises(ConfigError, match="^retention=192 is not allowed with mode=kernel; kernel supports "
                                          "retention=256$"):
        check_packed_rules("kernel", [256, 192], False, "mixed")
    with pytest.raises(ConfigError, match="^hicache=true is not allowed with retention=r128"):
        check_packed_rules("triton", [128], True, "r128")
    check_packed_rules("kernel", [256], True, "r256")
